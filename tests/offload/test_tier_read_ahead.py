"""The NVMe tier's read-ahead hands a chunk waiting for a buffer the next buffer freed, however the landed writes interleave."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from torch import nn

from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import make_plan
from lightning_accel.offload.tier_plan import SLOTS
from lightning_accel.offload.tier_setup import make_tier


def test_a_unit_waiting_for_a_buffer_gets_the_next_one_freed(tmp_path: Path) -> None:
    # Units 0-2 hold the three buffers (stepping, their writes not landed) when unit 3 asks for one. Each landed
    # write frees its buffer and reads ahead, both under the tier's lock, so unit 3's waiting thread cannot run in
    # between: the read-ahead must read unit 3, not unit 4, 5, 6 (which filled every buffer, and unit 3 waited forever).
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    plan = make_plan(model, "auto")
    store = HostStore(plan.blocks, torch.float32, pin=False)
    _, tier = make_tier(plan.blocks, store, torch.optim.AdamW(model.parameters()), None, str(tmp_path), pin=False)
    assert tier is not None and tier.buffers is not None and len(tier.buffers.slots) == SLOTS == 3
    buffers = tier.buffers
    try:
        tier.expect(range(8))  # (each unit one chunk)
        held = [buffers.take((i, 0)) for i in range(3)]
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.setdefault("slot", buffers.take((3, 0))), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 5
        while not buffers._lock._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.001)
        assert buffers._lock._waiters, "unit 3 did not wait for a buffer"  # type: ignore[attr-defined]
        for slot in held:
            with buffers._lock:  # what a landed write's callback does, with nothing in between
                buffers.release(slot)
                buffers._read_ahead()
        waiter.join(5)
        assert not waiter.is_alive(), "unit 3 never got a buffer: the freed ones were read ahead for later units"
        assert got["slot"].key == (3, 0)  # type: ignore[attr-defined]
    finally:
        tier.close()
