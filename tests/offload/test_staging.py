"""The pinned rings the copies cross (offload/staging.py) and the GPU code path on the CPU device
(offload/device_memory.py's stand-in): gradients landed piece by piece equal the whole tensor's widening and sum bit
for bit, weights arrive unchanged, and what is pinned is a few slots, reused."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.offload import L2LExecutor, make_plan
from lightning_accel.offload.device_memory import DeviceMemory, StandIn, standing_in
from lightning_accel.offload.staging import CopyRing, GradRing
from tests.support.offload_nets import Net


def _ring(slot_bytes: int, slots: int = 3) -> tuple[GradRing, dict[str, torch.Tensor], StandIn]:
    buffers: dict[str, torch.Tensor] = {}
    memory = StandIn()

    def land(key: str, part: torch.Tensor, start: int, fresh: bool) -> None:
        target = buffers.setdefault(key, torch.empty(sizes[key], dtype=torch.float32))[start:start + part.numel()]
        target.copy_(part) if fresh else target.add_(part)

    sizes = {"a": 1000, "b": 37, "c": 4096}
    return GradRing(memory, land, lambda key: key in buffers, slots=slots, slot_bytes=slot_bytes), buffers, memory


@pytest.mark.parametrize("slot_bytes", [64, 1000, 1 << 20], ids=["tiny-slots", "mid", "one-slot-per-gradient"])
def test_gradients_landed_in_pieces_equal_the_fp32_sum_of_the_whole_tensors(slot_bytes: int) -> None:
    torch.manual_seed(0)
    ring, buffers, memory = _ring(slot_bytes)
    sends = [(k, torch.randn(n).to(torch.bfloat16)) for _ in range(3) for k, n in (("a", 1000), ("b", 37), ("c", 4096))]
    expected: dict[str, torch.Tensor] = {}
    for i, (key, grad) in enumerate(sends):
        ring.send(key, grad, None, None)
        # the reference: the whole tensor widened, then summed in fp32 in arrival order (HostStore.add_grad's arithmetic)
        expected[key] = grad.to(torch.float32) if key not in expected else expected[key].add_(grad)
        if i == 4:
            ring.finish(["a"])  # the host step asks for one parameter while the others are still in flight
            assert torch.equal(buffers["a"], expected["a"]) and not ring.in_flight("a")
    ring.finish()
    for key in expected:
        assert torch.equal(buffers[key], expected[key]), key
    # pinned: at most the ring's slots, whatever went through
    assert ring.allocated_bytes == memory.pinned_bytes <= ring.slots * ring.slot_bytes
    assert all(r == ring.slot_bytes for r in memory.requests)


def test_weights_cross_the_copy_ring_unchanged_through_small_slots() -> None:
    memory = StandIn()
    ring = CopyRing(memory, slots=2, slot_bytes=100)
    tensors = [torch.randn(7, 13), torch.randn(3).to(torch.bfloat16), torch.randint(0, 9, (50,), dtype=torch.int8)]
    for tensor in tensors:
        out = ring.to_device(tensor, torch.device("cpu"), None)
        assert torch.equal(out, tensor) and out.data_ptr() != tensor.data_ptr()
    assert memory.pinned_bytes == 200


def test_the_layer_on_a_cpu_device_pins_nothing_and_has_no_stream() -> None:
    memory = DeviceMemory(torch.device("cpu"))
    assert not memory.staged and memory.new_stream() is None and memory.event() is None
    assert not memory.empty_pinned(10).is_pinned() and memory.pinned_bytes == 10


@pytest.mark.parametrize("checkpoint_blocks", [True, False])
def test_the_gpu_code_path_on_the_cpu_device_gives_plain_autograd_s_gradients(checkpoint_blocks: bool) -> None:
    torch.manual_seed(0)
    reference, model = Net(depth=5).double(), Net(depth=5).double()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(8, 4, dtype=torch.float64)
    reference(x).square().mean().backward()
    plan = make_plan(model, "auto", prefetch_blocks=1, offload_resident=True)
    with standing_in(StandIn()) as memory:
        executor = L2LExecutor(model, plan, torch.device("cpu"), checkpoint_blocks=checkpoint_blocks)
        assert executor.streamer.staged and not executor.streamer.alias and memory.pinned_bytes == 0  # nothing at set-up
        executor.streamer.size_staging(48)  # a few elements a slot: every gradient and weight crosses in pieces
        executor.attach()
        for _ in range(2):  # the second backward adds to the landed sums (accumulation)
            executor.begin_step()
            loss = model(x).square().mean()
            executor.begin_backward()
            loss.backward()
            executor.end_backward()
        executor.install_grads()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, 2 * q.grad), name
    assert memory.pinned_bytes == executor.streamer.staging_bytes() <= 6 * 48
