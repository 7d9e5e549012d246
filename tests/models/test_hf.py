"""hf_causal_lm: transformers causal LMs from a config or a local directory, and its refusals."""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

from lightning_accel.config.errors import UserError  # noqa: E402
from lightning_accel.models.extras import MissingExtraError  # noqa: E402
from lightning_accel.models.hf import DTYPES, directory_config, hf_causal_lm, make_config  # noqa: E402

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


TIED_LLAMA = {**TINY_LLAMA, "tie_word_embeddings": True}  # as llama-tiny_cpu; LlamaConfig's default is untied


def _saved(path, config=TIED_LLAMA, dtype: str = "float32", **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf_causal_lm(config, dtype=dtype)
    model.save_pretrained(path, **save_kwargs)
    return model


def _load(path, meta: bool, **kwargs) -> torch.nn.Module:
    """``hf_causal_lm`` as the pre-run check calls it (a meta default device) or as the run does."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return hf_causal_lm(pretrained_path=str(path), **kwargs)


def _edit_weights(path, edit) -> None:
    """Rewrite ``model.safetensors`` with ``edit(tensors)``, as a hand-edited or mixed-up checkpoint."""
    from safetensors.torch import load_file, save_file

    tensors = edit(load_file(path / "model.safetensors"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pretrained_directory_loads_bit_identical_weights_in_train_mode(tmp_path, dtype: str) -> None:
    saved = _saved(tmp_path, dtype=dtype)
    loaded = _load(tmp_path, meta=False, dtype=dtype)
    expected = saved.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, value in loaded.state_dict().items():
        assert value.dtype == DTYPES[dtype] and torch.equal(value, expected[name]), name
    # from_pretrained returns eval mode, and Lightning keeps it: dropout would be off in training
    assert all(m.training for m in loaded.modules())


GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 32,
        "bos_token_id": None, "eos_token_id": None}


def _gpt2_base_model_keys(tensors):  # a GPT2Model's save (hub gpt2): no transformer. prefix, an attn.bias mask
    return {**{k.removeprefix("transformer."): v for k, v in tensors.items()}, "h.0.attn.bias": torch.ones(1, 1, 32, 32)}


# what save_pretrained writes (tied: no lm_head.weight; sharded; pytorch_model.bin) and what
# transformers itself accepts (a base model's keys, buffers it marks ignorable)
LAYOUTS = {
    "llama tied": (TIED_LLAMA, {}, None),
    "llama untied": (TINY_LLAMA, {}, None),
    "llama sharded": (TIED_LLAMA, {"max_shard_size": "20KB"}, None),
    "llama old rotary buffer": (TIED_LLAMA, {}, lambda t: {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    "gpt2": (GPT2, {}, None),
    "gpt2 base-model keys": (GPT2, {}, _gpt2_base_model_keys),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_pretrained_layouts_pass_the_meta_check_and_load(tmp_path, layout: str) -> None:
    config, save_kwargs, edit = LAYOUTS[layout]
    saved = _saved(tmp_path, config, **save_kwargs)
    if edit is not None:
        _edit_weights(tmp_path, edit)
    meta = _load(tmp_path, meta=True)
    assert {p.device.type for p in meta.parameters()} == {"meta"}  # built from config.json, nothing read
    loaded = _load(tmp_path, meta=False)
    assert type(meta) is type(loaded) is type(saved)
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in loaded.state_dict().items()}
    torch.testing.assert_close(loaded.state_dict(), saved.state_dict(), rtol=0, atol=0)


def test_pytorch_model_bin_passes_the_meta_check_and_loads(tmp_path) -> None:
    saved = _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({k: v for k, v in saved.state_dict().items() if k != "lm_head.weight"}, tmp_path / "pytorch_model.bin")  # tied
    assert type(_load(tmp_path, meta=True)).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_load(tmp_path, meta=False).state_dict(), saved.state_dict(), rtol=0, atol=0)


def _write(path, name: str, text: str) -> None:
    (path / name).write_text(text)


def _drop(key: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def _edit_config(old: str, new: str):
    return lambda p: _write(p, "config.json", (p / "config.json").read_text().replace(old, new))


def _truncate(p) -> None:
    (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-100])


# each refusal: how the directory is broken, and the line, from the pre-run check (meta) and the real load
BROKEN = {
    "missing": (lambda p: None, r"pretrained_path='.*/nothing' does not exist; point it at a directory written by save_pretrained"),
    "a file": (lambda p: _write(p, "f", ""), r"pretrained_path='.*' is a file, not a directory"),
    "no config.json": (lambda p: (p / "config.json").unlink(), r"pretrained_path='.*' has no config.json; point it at"),
    "config.json not JSON": (lambda p: _write(p, "config.json", '{"model_type": "llama",'),
                             r"config.json is not valid JSON \(Expecting"),
    "no model_type": (lambda p: _write(p, "config.json", '{"hidden_size": 32}'), r"config.json has no model_type; write it again"),
    "not a causal LM": (lambda p: _write(p, "config.json", '{"model_type": "vit"}'),
                        r"config.json's model_type='vit' has no causal-LM model"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(),
                   r"has no weights file \(model.safetensors, model.safetensors.index.json, pytorch_model.bin, "),
    "truncated": (_truncate, r"model.safetensors cannot be read, truncated or corrupt \(.*incomplete metadata"),
    "missing tensor": (lambda p: _edit_weights(p, _drop("model.layers.1.mlp.up_proj.weight")),
                       r"the weights have no model.layers.1.mlp.up_proj.weight \(1 of the model's 21 tensors missing\), "
                       r"which would train from random values"),
    "tied embedding in neither place": (lambda p: _edit_weights(p, _drop("model.embed_tokens.weight")),
                                        r"the weights have no model.embed_tokens.weight \(2 of the model's 21"),
    "untied config, tied weights": (_edit_config('"tie_word_embeddings": true', '"tie_word_embeddings": false'),
                                    r"the weights have no lm_head.weight"),
    "unknown tensor": (lambda p: _edit_weights(p, lambda t: {**t, "model.extra.weight": torch.ones(2)}),
                       r"the weights hold model.extra.weight, which the model config.json builds does not have"),
    "wrong shape": (_edit_config('"intermediate_size": 64', '"intermediate_size": 96'),
                    r"model.layers.0.mlp.down_proj.weight is \(32, 64\) in the weights but \(32, 96\) in the model "
                    r"config.json builds \(6 of the model's 21 tensors differ\)"),
}


@pytest.mark.parametrize("meta", [True, False], ids=["pre-run check", "load"])
@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_directory_is_refused_in_one_line(tmp_path, broken: str, meta: bool) -> None:
    _saved(tmp_path / "model")
    path = {"missing": tmp_path / "nothing", "a file": tmp_path / "model" / "f"}.get(broken, tmp_path / "model")
    breaks, message = BROKEN[broken]
    breaks(tmp_path / "model")
    with pytest.raises(UserError, match=message) as info:
        _load(path, meta)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"model.net.pretrained_path={str(path)!r}")


@pytest.mark.parametrize("meta", [True, False], ids=["pre-run check", "load"])
def test_a_shard_the_index_names_must_be_there(tmp_path, meta: bool) -> None:
    _saved(tmp_path, max_shard_size="20KB")
    (tmp_path / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(UserError, match=r"model.safetensors.index.json names model-00002-of-00006.safetensors, which is not in "
                                        r"the directory \(1 of 6 shards missing\)"):
        _load(tmp_path, meta)


@pytest.mark.parametrize("meta", [True, False], ids=["pre-run check", "load"])
def test_a_moe_checkpoint_missing_an_expert_is_refused(tmp_path, meta: bool) -> None:
    # Mixtral is saved per expert and fused into one tensor per layer when loaded (transformers' conversions)
    _saved(tmp_path, {**TIED_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    _edit_weights(tmp_path, _drop("model.layers.0.block_sparse_moe.experts.1.w1.weight"))
    # the pre-run check names the fused tensor; the real load, after transformers' report, says it does not convert
    message = r"the weights have no model.layers.0.mlp.experts.gate_up_proj" if meta else r"the weights do not convert into the model"
    with pytest.raises(UserError, match=message):
        _load(tmp_path, meta)


def test_a_directory_describes_its_architecture_and_refuses_a_contradicting_value(tmp_path) -> None:
    """What ``run RECIPE model.net.pretrained_path=DIR`` checks the user's model.net.config keys against: config.json, and
    the config class's defaults and its other names for what config.json leaves out (GPT-2's n_embd is hidden_size)."""
    _saved(tmp_path / "llama")
    assert directory_config(tmp_path / "llama", {}) == "llama: 2 layers, hidden_size 32, vocab_size 64"
    assert directory_config(tmp_path / "llama", {"hidden_size": 32, "num_key_value_heads": 2, "rope_theta": 10000.0}).startswith("llama")
    with pytest.raises(UserError) as info:
        directory_config(tmp_path / "llama", {"num_hidden_layers": 4})
    assert str(info.value) == (
        f"model.net.config.num_hidden_layers=4 contradicts model.net.pretrained_path={str(tmp_path / 'llama')!r}, whose config.json "
        "has num_hidden_layers=2; drop model.net.config.num_hidden_layers (the directory's config is used as saved), or point "
        "pretrained_path at a checkpoint saved with num_hidden_layers=4")
    with pytest.raises(UserError, match=r"model.net.config.hiden_size=32 is not a key of the llama config.json in"):
        directory_config(tmp_path / "llama", {"hiden_size": 32})
    _saved(tmp_path / "gpt2", {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64})
    assert directory_config(tmp_path / "gpt2", {"hidden_size": 32}) == "gpt2: 2 layers, n_embd 32, vocab_size 64"
    with pytest.raises(UserError, match=r"model.net.config.hidden_size=64 contradicts .* config.json has hidden_size=32"):
        directory_config(tmp_path / "gpt2", {"hidden_size": 64})
    with pytest.raises(UserError, match=r"pretrained_path='.*/gone' does not exist"):
        directory_config(tmp_path / "gone", {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {**TINY_LLAMA, "hidden_sizee": 64}}, r"'hidden_sizee' is not a LlamaConfig key \(did you mean 'hidden_size'"),
        ({"config": {**TINY_LLAMA, "model_type": "lama"}}, r"model_type='lama' has no causal-LM model.*did you mean 'llama'"),
        ({"config": {"hidden_size": 32}}, r"config needs model_type"),
        ({}, r"needs a config .* or a pretrained_path"),
        ({"config": TINY_LLAMA, "pretrained_path": "/x"}, r"both pretrained_path='/x' and a config.*model.net.config=null"),
        ({"config": TINY_LLAMA, "dtype": "fp32"}, r"dtype='fp32' is not one of float32"),
    ],
)
def test_bad_input_is_refused_with_the_fix(kwargs, message) -> None:
    with pytest.raises(UserError, match=message):
        hf_causal_lm(**kwargs)


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


def test_load_by_block_builds_on_meta_and_loads_only_from_safetensors(tmp_path) -> None:
    from lightning_accel.offload.materialize import materialize

    saved = _saved(tmp_path, dtype="bfloat16")
    net = hf_causal_lm(pretrained_path=str(tmp_path), load_by_block=True)
    assert {p.device.type for p in net.parameters()} == {"meta"} and net.training
    materialize(net, {}, [], None)  # what strategy=l2l_offload does, unit by unit
    torch.testing.assert_close(net.state_dict(), _load(tmp_path, meta=False).state_dict(), rtol=0, atol=0)
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    with pytest.raises(UserError, match="load_by_block=true loads a pretrained_path"):
        hf_causal_lm(TINY_LLAMA, load_by_block=True)
    (tmp_path / "model.safetensors").unlink()
    torch.save(saved.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"has no model\.safetensors .* reads safetensors files only"):
        hf_causal_lm(pretrained_path=str(tmp_path), load_by_block=True)
