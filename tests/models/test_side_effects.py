"""KV-cache settings, cache arguments and buffer writes: found, neutralized, refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.models.side_effects import (
    BufferRestore,
    KVCacheSwitch,
    buffer_versions,
    cache_argument,
    describe_cache_refusal,
    disable_kv_cache,
    mutated_buffers,
)


def _cache_kwarg() -> str:
    """The keyword transformers hands a decoder layer its cache by: ``cache`` from 5.24, ``past_key_values`` before."""
    import inspect

    transformers = pytest.importorskip("transformers")
    return "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers, transformers.LlamaForCausalLM(cfg)


def test_disable_kv_cache_names_each_config_once_and_restores() -> None:
    _, net = _llama()
    assert net.config.use_cache is True  # transformers' default
    changed = disable_kv_cache(net)
    assert changed == ["config.use_cache"]  # LlamaForCausalLM and its .model share one config object
    assert net.config.use_cache is False and net.model.config.use_cache is False
    assert disable_kv_cache(net) == []  # nothing left to change
    changed.restore()
    assert net.config.use_cache is True and changed == []


def test_kv_cache_switch_says_once_and_restores() -> None:
    _, net = _llama()
    switch = KVCacheSwitch("L2LOffloadStrategy", "recomputing")
    assert switch.off(net) == (
        "L2LOffloadStrategy: `use_cache=True` is incompatible with recomputing blocks (the KV cache would grow twice). "
        "Setting `use_cache=False` (config.use_cache) for this run; restored at teardown"
    )
    net.config.use_cache = True  # changed behind its back within the fit: a second off() is a no-op until restore()
    assert switch.off(net) is None and net.config.use_cache is True
    net.config.use_cache = False
    switch.restore()
    assert net.config.use_cache is True and switch.settings is None
    switch.restore()  # idempotent
    assert KVCacheSwitch("x", "y").off(nn.Linear(2, 2)) is None  # nothing to change, nothing to say


def test_disable_kv_cache_leaves_other_models_alone() -> None:
    assert disable_kv_cache(nn.Sequential(nn.Linear(2, 2))) == []


def test_a_cache_argument_is_found_and_refused_in_one_line() -> None:
    transformers, net = _llama()
    CACHE_KWARG = _cache_kwarg()
    seen: list[str | None] = []
    layer = net.model.layers[1]
    layer.register_forward_pre_hook(lambda m, a, k: seen.append(cache_argument(a, k)), with_kwargs=True)
    net(torch.randint(0, 64, (1, 4)))  # use_cache on: the model makes a DynamicCache and hands it to each layer
    assert seen == [CACHE_KWARG]
    disable_kv_cache(net)
    net(torch.randint(0, 64, (1, 4)))
    assert seen == [CACHE_KWARG, None]
    assert cache_argument((torch.ones(1), transformers.DynamicCache()), {}) == "args[1]"
    msg = describe_cache_refusal("GPipeStrategy", "model.layers.1", layer, CACHE_KWARG, transformers.DynamicCache(), "recomputing it in backward")
    with pytest.raises(RuntimeError, match=rf"block 'model.layers.1' \(LlamaDecoderLayer\) was called with a DynamicCache \({CACHE_KWARG}\); recomputing .*; do not pass use_cache=True or a cache \(cache= / past_key_values=\)"):
        raise RuntimeError(msg)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mask", torch.ones(3))  # read, never written
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        self.calls += 1
        return self.norm(self.lin(x) * self.mask)


def test_mutated_buffers_sees_in_place_writes_and_replacements() -> None:
    block = Counter()
    before = buffer_versions(block)
    block(torch.randn(4, 3))
    assert mutated_buffers(block, before) == ["calls", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert mutated_buffers(block, before, exempt=(nn.BatchNorm1d,)) == ["calls"]
    before = buffer_versions(block)
    block.mask = torch.zeros(3)  # replaced, not written
    assert mutated_buffers(block, before, exempt=(nn.BatchNorm1d,)) == ["mask"]
    assert mutated_buffers(block.eval(), before) == ["mask"]  # BatchNorm in eval mode writes nothing


def test_buffer_restore_undoes_a_recomputation_even_when_it_stops_early() -> None:
    block, x = Counter(), torch.randn(4, 3)
    restore = BufferRestore()
    before = buffer_versions(block)
    block(x)
    restore.observe(block, before)
    after_forward = {n: b.clone() for n, b in block.named_buffers()}
    with restore.recompute(block):
        block(x)
    with pytest.raises(KeyError), restore.recompute(block):
        block(x)
        raise KeyError("stopped early")  # as torch.utils.checkpoint stops a recomputation
    for name, buf in block.named_buffers():
        torch.testing.assert_close(buf, after_forward[name], rtol=0, atol=0)
    assert block.calls.item() == 1
