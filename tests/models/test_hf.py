"""hf_causal_lm: transformers causal LMs from a config or a local directory, and its refusals."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

from lightning_accel.config.errors import UserError  # noqa: E402
from lightning_accel.models.extras import MissingExtraError  # noqa: E402
from lightning_accel.models.hf import hf_causal_lm, make_config  # noqa: E402

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "use_cache": False,
}


def test_config_builds_that_architecture_in_float32() -> None:
    torch.manual_seed(0)
    net = hf_causal_lm(TINY_LLAMA)
    assert type(net).__name__ == "LlamaForCausalLM"
    cfg = net.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.use_cache) == (32, 2, 2, False)
    assert len(net.model.layers) == 2 and net.model.layers[0].self_attn.k_proj.out_features == 2 * 8  # 2 kv heads x 8
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    out = net(torch.randint(0, 64, (3, 10)))
    assert out.logits.shape == (3, 10, 64)


def test_other_model_types_and_legacy_rope_keys() -> None:
    gpt2 = hf_causal_lm({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32})
    assert type(gpt2).__name__ == "GPT2LMHeadModel" and len(gpt2.transformer.h) == 2
    # config.json's rope_theta / rope_scaling (transformers 4 names) still reach rope_parameters
    cfg = make_config({**TINY_LLAMA, "rope_theta": 500000.0, "max_position_embeddings": 16384, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rope_parameters["rope_type"] == "llama3"


def test_config_from_hydra_is_made_plain() -> None:
    # Hydra passes nested OmegaConf containers; transformers type-checks rope_parameters as a dict
    from omegaconf import OmegaConf

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    net = hf_causal_lm(OmegaConf.create({**TINY_LLAMA, "max_position_embeddings": 256, "rope_parameters": rope}))
    assert net.config.rope_parameters == rope


def test_dtype_and_attention_implementation_are_passed_on() -> None:
    net = hf_causal_lm(TINY_LLAMA, dtype="float64", attn_implementation="eager")
    assert {p.dtype for p in net.parameters()} == {torch.float64}
    assert net.config._attn_implementation == "eager"


def test_pretrained_directory_loads_its_weights_in_float32(tmp_path) -> None:
    torch.manual_seed(0)
    saved = hf_causal_lm(TINY_LLAMA, dtype="bfloat16")
    saved.save_pretrained(tmp_path)
    loaded = hf_causal_lm(pretrained_path=str(tmp_path))
    # the directory holds bf16 weights; training wants fp32 parameters (transformers 5 would keep bf16)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    expected = saved.state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name].float(), rtol=0, atol=0, msg=name)
    assert loaded.config.hidden_size == 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {**TINY_LLAMA, "hidden_sizee": 64}}, r"'hidden_sizee' is not a LlamaConfig key \(did you mean 'hidden_size'"),
        ({"config": {**TINY_LLAMA, "model_type": "lama"}}, r"model_type='lama' has no causal-LM model.*did you mean 'llama'"),
        ({"config": {"hidden_size": 32}}, r"config needs model_type"),
        ({}, r"needs a config .* or a pretrained_path"),
        ({"config": TINY_LLAMA, "pretrained_path": "/x"}, r"both pretrained_path='/x' and a config.*model.net.config=null"),
        ({"pretrained_path": "/no/such/dir"}, r"pretrained_path='/no/such/dir' has no config.json"),
        ({"config": TINY_LLAMA, "dtype": "fp32"}, r"dtype='fp32' is not one of float32"),
    ],
)
def test_bad_input_is_refused_with_the_fix(kwargs, message) -> None:
    with pytest.raises(UserError, match=message):
        hf_causal_lm(**kwargs)


def test_directory_without_weights_is_one_line(tmp_path) -> None:
    make_config(TINY_LLAMA).save_pretrained(tmp_path)  # config.json only
    with pytest.raises(UserError, match=f"pretrained_path='{tmp_path}': ") as info:
        hf_causal_lm(pretrained_path=str(tmp_path))
    assert "\n" not in str(info.value)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "lightning_accel.models.hf")
    with pytest.raises(MissingExtraError, match=r'model=hf_causal_lm needs transformers.*pip install "lightning-accel\[hf\]"'):
        importlib.import_module("lightning_accel.models.hf")


def test_builders_are_exported_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_accel.models as models

    assert models.hf_causal_lm is hf_causal_lm
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "lightning_accel.models.hf")
    with pytest.raises(MissingExtraError, match=r"lightning-accel\[hf\]"):
        models.hf_causal_lm  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'hf_causal_llm'"):
        models.hf_causal_llm  # noqa: B018


def test_validate_reports_the_missing_extra_as_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from lightning_accel import cli

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "lightning_accel.models.hf")
    assert cli.main(["validate", "llama-tiny_cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith('pip install "lightning-accel[hf]"'), err
