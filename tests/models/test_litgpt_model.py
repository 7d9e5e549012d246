"""litgpt_gpt: litgpt's GPT from a named config or Config fields, and its refusals."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("litgpt", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

from litgpt import GPT  # noqa: E402

from lightning_accel.config.errors import UserError  # noqa: E402
from lightning_accel.models.extras import MissingExtraError  # noqa: E402
from lightning_accel.models.litgpt_model import litgpt_gpt  # noqa: E402

SHRINK = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "padded_vocab_size": 64, "block_size": 16}


def test_named_config_with_overrides() -> None:
    net = litgpt_gpt("pythia-14m", SHRINK)
    assert isinstance(net, GPT)
    assert net.config.name == "pythia-14m" and net.config.parallel_residual  # the named architecture's choices kept
    assert (net.config.n_layer, net.config.n_embd, net.config.padded_vocab_size) == (2, 32, 64)
    assert net(torch.randint(0, 64, (2, 16))).shape == (2, 16, 64)


def test_llama_3_2_1b_by_name_is_the_published_size() -> None:
    with torch.device("meta"):
        net = litgpt_gpt("Llama-3.2-1B")
    # transformers' LlamaForCausalLM has 1,235,814,400 with the head tied to the embedding;
    # litgpt 0.5 keeps a separate 128256 x 2048 head
    assert sum(p.numel() for p in net.parameters()) == 1_235_814_400 + 128256 * 2048


def test_config_fields_alone() -> None:
    net = litgpt_gpt(config={**SHRINK, "n_query_groups": 2, "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP",
                             "intermediate_size": 64, "bias": False})
    assert net.config.n_query_groups == 2 and type(net.transformer.h[0].mlp).__name__ == "LLaMAMLP"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "pythia-14mm"}, r"name='pythia-14mm' is not a litgpt config \(did you mean 'pythia-14m'"),
        ({"name": "pythia-14m", "config": {"n_layerr": 2}}, r"'n_layerr' is not a litgpt Config field \(did you mean 'n_layer'"),
        ({}, r"needs a config name .* or Config fields"),
    ],
)
def test_bad_input_is_refused_with_the_fix(kwargs, message) -> None:
    with pytest.raises(UserError, match=message):
        litgpt_gpt(**kwargs)


def test_missing_litgpt_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litgpt", None)
    monkeypatch.delitem(sys.modules, "lightning_accel.models.litgpt_model")
    with pytest.raises(MissingExtraError, match=r'model=litgpt needs litgpt.*pip install "lightning-accel\[hf\]"'):
        importlib.import_module("lightning_accel.models.litgpt_model")
