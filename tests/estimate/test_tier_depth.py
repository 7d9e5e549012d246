"""The NVMe tier's host bytes are bounded by what is in flight, not by depth: the plan (``estimate``'s, the strategy's own
on fake tensors) of the same model at twice the depth, everything on disk, keeps less than 5% more host memory."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_accel.estimate.fake import fake_parameters
from lightning_accel.estimate.tier import tier_plan
from lightning_accel.models import GPT
from lightning_accel.offload.tier_plan import TierPlan

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

# llama-3.1-8b_full-nvme_1gpu's model (meta-llama/Llama-3.1-8B's config.json), bf16-mixed, AdamW
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=128256, tie_word_embeddings=False, use_cache=False)


def _llama(layers: int, cuda: bool) -> TierPlan:
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **LLAMA_8B))
    fake_parameters(net, FakeTensorMode())  # nothing allocated
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    return tier_plan(net, [optimizer], compute_dtype=torch.bfloat16, nvme_path="unused", cuda=cuda)


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu-device"])
def test_the_8b_recipe_s_host_bytes_do_not_grow_with_depth(cuda: bool) -> None:
    shallow, deep = _llama(32, cuda), _llama(64, cuda)
    assert all(deep.state_on_disk) and all(deep.masters_on_disk) and all(deep.weights_on_disk)
    # what stays: 4 blocks' fp32 gradients (the blocks step during the backward), 3 step buffers of a 64 MiB chunk (not of
    # a block's 3 GB of state, masters and shadows), 3 buffers of a block's bf16 shadows for the compute's reads; on the
    # CPU device the resident unit (the 128k-vocabulary embedding and head with their AdamW state) besides
    assert shallow.grad_bytes == deep.grad_bytes == 4 * 218_112_000 * 4 and deep.step_buffer == 64 << 20
    assert deep.buffer_bytes == 3 * (64 << 20) + 3 * deep.weight_buffer and deep.weight_buffer == 218_103_808 * 2 + 2 * 4096 * 4  # (the norms in fp32)
    # on a GPU the copies cross 6 pinned slots of one chunk (offload/staging.py), not a buffer per parameter (13.96 GB at
    # 32 layers, 27.9 GB at 64, before)
    assert shallow.staging_bytes == deep.staging_bytes == (6 * (64 << 20) if cuda else 0)
    assert deep.host_bytes < 1.05 * shallow.host_bytes, (shallow.describe(), deep.describe())


def test_the_gpt_tiny_recipe_s_host_bytes_do_not_grow_with_depth() -> None:
    # gpt-tiny_l2l_cpu's model on the CPU device in fp32 at 4 and 8 blocks: the blocks compute on their masters, read
    # from disk into 3 buffers; the resident unit kept on the device counts (host memory there)
    plans = []
    for layers in (4, 8):
        net = GPT("tiny", n_layer=layers)
        plans.append(tier_plan(net, [torch.optim.AdamW(net.parameters(), lr=1e-3)], nvme_path="unused"))
    shallow, deep = plans
    assert deep.resident_kept == shallow.resident_kept > 0 and deep.grads_in_flight == 4
    assert deep.host_bytes < 1.05 * shallow.host_bytes, (shallow.describe(), deep.describe())


# llama-3.1-70b_full-nvme_1gpu's model (meta-llama/Llama-3.1-70B's config.json) and gpt-175b_full-nvme_1gpu's (GPT-3's shape)
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64}


def _large(recipe: str, layers: int) -> TierPlan:
    with torch.device("meta"):
        if recipe == "llama-70b":
            net = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **LLAMA_70B))
        else:
            net = GPT("gpt2-xl", vocab_size=50257, block_size=2048, n_embd=12288, n_head=96, n_layer=layers)
    fake_parameters(net, FakeTensorMode())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    return tier_plan(net, [optimizer], compute_dtype=torch.bfloat16, nvme_path="unused", cuda=True, offload_resident=True,
                     offload_activations=True)


@pytest.mark.parametrize("recipe", ["llama-70b", "gpt-175b"])
def test_the_largest_recipes_host_bytes_do_not_grow_with_depth(recipe: str) -> None:
    # the recipes' settings on a GPU (the resident unit streamed, activations on the host: theirs, in the device's column),
    # everything on disk, at 4 and 8 of their blocks: 4 blocks' fp32 gradients, 3 step buffers of a chunk, the compute's
    # weight buffers, 6 pinned slots of a chunk; nothing of it per block
    shallow, deep = _large(recipe, 4), _large(recipe, 8)
    assert all(deep.state_on_disk) and all(deep.masters_on_disk) and deep.held == 1
    assert deep.staging_bytes == shallow.staging_bytes == 6 * deep.staging_slot <= 6 * (64 << 20)
    assert deep.host_bytes < 1.05 * shallow.host_bytes, (shallow.describe(), deep.describe())
    assert "for the device: the resident unit streamed (offload_resident" in deep.describe()
    assert "the blocks' inputs on the host (offload_activations)" in deep.describe()


@pytest.mark.parametrize(("recipe", "depth", "layers", "host"), [
    ("llama-3.1-70b_full-nvme_1gpu", "model.net.config.num_hidden_layers", 80, 64e9),
    ("gpt-175b_full-nvme_1gpu", "model.net.n_layer", 96, 128e9),
])
def test_the_largest_recipes_fit_a_24_gb_gpu_and_their_host(recipe: str, depth: str, layers: int, host: float) -> None:
    from lightning_accel.estimate import estimate_recipe

    # the recipe as shipped at 4 of its blocks (the whole estimate at full depth takes minutes on fake tensors; its
    # figures are in docs/offload.md): the device's bytes do not depend on the depth (one block's compute, the resident
    # unit streamed, the blocks' inputs on the host), the plan keeps its budget at any depth, and what the host holds
    # beyond the plan grows by one parked block input a block
    estimate = estimate_recipe(recipe, [f"{depth}=4"])
    (rank,) = estimate.ranks
    assert rank.device_peak_bytes <= 24e9, rank.device
    assert estimate.tier is not None and estimate.tier.budget is not None and estimate.tier.host_bytes <= estimate.tier.budget
    parked = rank.host["parked block inputs"] / 4 * layers
    beyond = sum(rank.host.values()) - estimate.tier.host_bytes - rank.host["parked block inputs"]  # (the loader's batches)
    assert estimate.tier.budget + parked + beyond <= host, (estimate.tier.budget, parked, beyond)
    assert "for the device: the resident unit streamed" in estimate.tier.describe()


def test_the_70b_recipe_left_to_the_plan_streams_its_resident_unit_for_its_24_gb_device() -> None:
    from lightning_accel.estimate import estimate_recipe

    # offload_resident unset: the plan knows the recipe's device (24 GB, from its purpose) and that the resident unit kept
    # there (33.6 GB with its gradients and fp32 AdamW state) would not fit it, so it streams it and says why; the device
    # then fits, as with the recipe's own offload_resident=true
    estimate = estimate_recipe("llama-3.1-70b_full-nvme_1gpu", ["model.net.config.num_hidden_layers=4", "strategy.offload_resident=null"])
    (rank,) = estimate.ranks
    assert estimate.tier is not None and estimate.tier.held == 1 and rank.device_peak_bytes <= 24e9, rank.device
    assert "for the device: the plan streamed the resident unit (33.62 GB with its gradients and optimizer state" in estimate.tier.describe()
    assert "over the device's 24.00 GB)" in estimate.tier.describe()
