"""``model.net.load_by_block=true`` as docs/models.md, docs/offload.md and llama-3.1-8b_full-nvme_1gpu's comment write it
(no ``+``): the key is in the model's config, so the documented commands compose, pass preflight and build the model on
meta for the strategy to load block by block. Before: "unknown key ... add a new key with +model.net.load_by_block"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.preflight import preflight

pytest.importorskip("transformers", reason="needs the hf extra")


def _save_tiny_llama(path: Path) -> None:
    from lightning_accel.models.hf import hf_causal_lm

    torch.manual_seed(0)
    hf_causal_lm({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True,
                  "use_cache": False}).save_pretrained(path)


@pytest.mark.parametrize(("recipe", "extra"), [
    ("llama-tiny_cpu", ["strategy=l2l_offload", "strategy.nvme_path={tmp}/nvme"]),  # docs/models.md, docs/offload.md
    ("llama-3.1-8b_full-nvme_1gpu", []),  # the recipe's comment: model.net.pretrained_path=DIR model.net.load_by_block=true
], ids=["docs", "8b-recipe"])
def test_the_documented_command_passes_preflight_and_builds_on_meta(tmp_path: Path, recipe: str, extra: list[str]) -> None:
    assert compose_recipe(recipe, []).model.net.load_by_block is False  # in the model's config, off by default
    _save_tiny_llama(tmp_path / "mine")
    overrides = [o.format(tmp=tmp_path) for o in extra] + [f"model.net.pretrained_path={tmp_path / 'mine'}",
                                                           "model.net.load_by_block=true"]
    cfg = preflight(recipe, overrides, launch=False)
    assert cfg.model.net.load_by_block is True
    if recipe == "llama-tiny_cpu":  # (the 8B recipe's model is the directory's here too; one build is enough)
        net = instantiate(cfg.model).net
        assert {p.device.type for p in net.parameters()} == {"meta"}  # nothing read yet: the strategy loads it by block
