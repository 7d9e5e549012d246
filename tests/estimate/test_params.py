"""Optimizer state and step scratch, and NF4 bytes, against the real thing on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_accel.estimate.fake import fake_parameters
from lightning_accel.estimate.params import measure_optimizer, nf4_nbytes
from lightning_accel.offload.optimizer_state import state_bytes
from lightning_accel.stored import stored_nbytes


class _Task(nn.Module):
    def __init__(self, optimizer: type[torch.optim.Optimizer]) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_state_and_foreach_scratch_match_torch_memory_tracker(optimizer: type[torch.optim.Optimizer], seed: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    real = _Task(optimizer)
    opt = optimizer(real.parameters(), lr=1e-3, foreach=True)
    for p in real.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates the state
    tracker = MemTracker()
    tracker.track_external(real, opt)
    with tracker:
        opt.step()
    peak = {str(getattr(k, "value", k)): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    state = state_bytes(opt)

    task, mode = _Task(optimizer), FakeTensorMode()
    fake_parameters(task.net, mode)
    measured = measure_optimizer(task, task.net, mode, foreach=True)
    assert sum(measured.state.values()) == state
    assert measured.scratch == peak["Optstate"] - state  # what the step makes beyond the state it keeps


@pytest.mark.parametrize(
    ("shape", "block", "scaler", "dtype"),
    [((1024, 768), 64, 256, torch.bfloat16), ((512, 512), 32, 128, torch.bfloat16), ((1024, 768), 64, 256, torch.float32)],
)
def test_nf4_bytes_are_torchao_s(shape: tuple[int, int], block: int, scaler: int, dtype: torch.dtype) -> None:
    pytest.importorskip("torchao")
    from lightning_accel.models.quantize import load_to_nf4

    weight = load_to_nf4()(torch.randn(shape, dtype=dtype), block, scaler)
    assert nf4_nbytes(shape[0] * shape[1], block, scaler, dtype) == stored_nbytes(weight)
