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


class _Adapters(nn.Module):
    """Many trainable tensors of few shapes, a frozen base, two groups that keep different state, one parameter no optimizer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(64, 64) for _ in range(4)).requires_grad_(False)
        self.a = nn.ParameterList(nn.Parameter(torch.empty(8, 64)) for _ in range(6))
        self.b = nn.ParameterList(nn.Parameter(torch.empty(64, 8)) for _ in range(6))
        self.norm = nn.Parameter(torch.empty(64))
        self.loose = nn.Parameter(torch.empty(64, 8))
        self.optimizers: list[torch.optim.Optimizer] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [
            {"params": [*self.base.parameters(), *self.a, self.norm]},
            {"params": list(self.b), "amsgrad": True},  # a third moment: the stand-ins are per group
        ]
        self.optimizers.append(torch.optim.AdamW(groups, lr=1e-3))
        return self.optimizers[-1]


def test_state_from_stand_ins_is_every_parameter_s() -> None:
    (full, full_mode), (standing, standing_mode) = (_Adapters(), FakeTensorMode()), (_Adapters(), FakeTensorMode())
    fake_parameters(full, full_mode)
    fake_parameters(standing, standing_mode)
    every = measure_optimizer(full, full, full_mode, scratch=True).state  # the scratch needs every parameter stepped
    stood = measure_optimizer(standing, standing, standing_mode, scratch=False).state
    assert stood == every
    assert every["a.0"] == every["a.5"] == 2 * 8 * 64 * 4 + 4 and every["b.0"] == 3 * 64 * 8 * 4 + 4
    assert every["loose"] == every["base.0.weight"] == 0
    # one step per group and kind: a's shape and the norm's in the first group, b's in the second
    assert len(full.optimizers[0].state) == 6 + 6 + 1 and len(standing.optimizers[0].state) == 3
    assert all(p.grad is None for p in standing.parameters())
