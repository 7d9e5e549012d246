"""materialize: a model built on meta given real tensors module by module, from a save_pretrained directory (the same
weights as from_pretrained, bit for bit) or its initializer; disk units through staging files, never all in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_accel.offload.materialize import Staging, load_by_block, materialize, meta_names, settle
from lightning_accel.offload.plan import make_plan

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, use_cache=False)


def _llama(tied: bool = True, meta: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def _units(model: nn.Module) -> tuple[dict[int, int], list[int]]:
    plan = make_plan(model)
    return {id(p): i for i, u in enumerate(plan.blocks) for _, p in u.params}, list(range(len(plan.blocks)))


@pytest.mark.parametrize(("saved_dtype", "tied"), [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32-tied", "bf16-cast"])
def test_a_checkpoint_loaded_by_block_equals_from_pretrained_bit_for_bit(tmp_path: Path, saved_dtype: torch.dtype, tied: bool) -> None:
    torch.manual_seed(0)
    _llama(tied).to(saved_dtype).save_pretrained(tmp_path / "ckpt")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    model = load_by_block(_llama(tied, meta=True), tmp_path / "ckpt")
    unit_of, disk = _units(model)
    done = materialize(model, unit_of, disk, str(tmp_path / "staging"))
    assert not meta_names(model)
    assert plain.state_dict().keys() == model.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    # the blocks went through staging files, whose names are gone already; at most one block new in memory at once
    block = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers)
    assert done.staged_bytes == 3 * block and done.peak_bytes <= done.in_memory_bytes + block
    assert not any((tmp_path / "staging").iterdir())
    assert done.staging is not None and done.staging.holds(model.model.layers[1].mlp.up_proj.weight)
    assert not done.staging.holds(model.model.embed_tokens.weight)


def test_a_plain_module_gets_reset_parameters_in_construction_order_as_built_on_the_cpu() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 8), *[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8)) for _ in range(3)])

    torch.manual_seed(0)
    cpu = build()
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = build()
    materialize(meta, {}, [], None)
    for (name, value), other in zip(cpu.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(value, other), name


def test_a_transformers_model_gets_its_own_init_weights() -> None:
    model = _llama(meta=True)
    materialize(model, {}, [], None)
    std = model.config.initializer_range
    cpu = _llama()
    # transformers' distributions (not the same draws: the CPU build also draws in each Linear's constructor)
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - std) < 0.2 * std
    assert torch.equal(model.model.rotary_emb.inv_freq, cpu.model.rotary_emb.inv_freq)  # a buffer no checkpoint holds


def test_what_nothing_can_fill_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path / "small")
    wider = transformers.LlamaConfig(**{**LLAMA, "intermediate_size": 96})
    with torch.device("meta"):
        model = load_by_block(transformers.AutoModelForCausalLM.from_config(wider), tmp_path / "small")
    with pytest.raises(ValueError, match=r"parameter model\.layers\.0\.mlp\.gate_proj\.weight has shape \(96, 32\) but .* holds "
                                         r"model\.layers\.0\.mlp\.gate_proj\.weight as \(64, 32\)"):
        materialize(model, {}, [], str(tmp_path / "staging"))

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"owner: parameter 1\.gain is on the meta device and Scale has no reset_parameters\(\)"):
        materialize(bare, {}, [0], str(tmp_path / "staging"), owner="owner")
    assert meta_names(bare) == ["0.weight", "0.bias", "1.gain"] and not (tmp_path / "staging").exists()


def test_settle_brings_the_staged_parameters_the_tier_kept_into_memory(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch.manual_seed(0)
    done = materialize(model, {id(model[0].weight): 0, id(model[0].bias): 0}, [0], str(tmp_path))
    staging = done.staging
    assert isinstance(staging, Staging) and staging.holds(model[0].weight) and not staging.holds(model[1].weight)
    master = {p: p.data for p in model.parameters()}
    shadow = dict(master)
    values = model[0].weight.detach().clone()
    moved = settle(model.parameters(), master, shadow, staging, pin=False)
    assert moved == 4 * 4 * 4 + 4 * 4
    weight = model[0].weight
    assert not staging.holds(weight) and master[weight].data_ptr() == weight.data_ptr() and shadow[weight] is master[weight]
    assert torch.equal(model[0].weight, values)
    staging.close()
    assert not staging.ranges


def test_an_adapter_on_meta_is_refused_peft_alone_can_initialize_it() -> None:
    peft = pytest.importorskip("peft")
    with torch.device("meta"):
        model = peft.get_peft_model(_llama(meta=True), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"q_proj\.base_layer\.weight is on the meta device inside a peft adapter's layer"):
        materialize(model, {}, [], None)
