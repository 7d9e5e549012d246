"""Two gloo processes train the same model under each communication option.

Reference: the same run with DDP's own all-reduce. Tolerances, in float64:
- bucket size, static graph and the explicit all-reduce hook change no arithmetic:
  identical weights (exact);
- no_sync accumulation (one all-reduce per step) against all-reducing every
  micro-batch: the same sum in another order, so equal to float64 rounding (rtol 1e-10);
- fp16 compression (float64 gradients sent as 2-byte halves): losses within 1e-3 relative, weights differ (the hook ran);
- PowerSGD rank 2 with error feedback: losses within 2e-2 relative, weights differ.
Traffic is checked against arithmetic: fp16 sends exactly 2 of every 8 bytes, no_sync
exactly 1/4 of all-reducing 4 micro-batches, PowerSGD far fewer.
"""

from __future__ import annotations

import pytest
import torch

from lightning_accel.comm import CommHookSpec, DDPOption, probe

OPTIONS = [
    DDPOption("builtin", hook=CommHookSpec("none")),
    DDPOption("plain"),
    DDPOption("bucket", bucket_cap_mb=0.01),
    DDPOption("static", static_graph=True),
    DDPOption("fp16", hook=CommHookSpec("fp16")),
    DDPOption("powersgd", hook=CommHookSpec("powersgd", powersgd_rank=2)),
    DDPOption("no_sync", accumulate=4),
    DDPOption("sync_every", accumulate=4, sync_every_micro_batch=True),
]


@pytest.fixture(scope="module")
def results() -> dict:
    out = probe(OPTIONS, steps=8, warmup=2, batch=16, width=64, depth=3, dtype="float64", timeout_s=240)
    return {r.label: r for r in out}


def _same(a, b, **tol) -> None:
    for x, y in zip(a.params, b.params, strict=True):
        torch.testing.assert_close(x, y, **tol)


def _differ(a, b) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))


def test_layout_options_change_no_arithmetic(results: dict) -> None:
    plain = results["plain"]
    _same(results["builtin"], plain, rtol=1e-12, atol=1e-14)
    _same(results["bucket"], plain, rtol=0, atol=0)
    _same(results["static"], plain, rtol=0, atol=0)
    assert results["bucket"].calls_per_step > plain.calls_per_step  # smaller buckets: more messages
    assert results["bucket"].bytes_per_step == plain.bytes_per_step


def test_no_sync_accumulation_equals_syncing_every_micro_batch(results: dict) -> None:
    no_sync, every = results["no_sync"], results["sync_every"]
    _same(no_sync, every, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(no_sync.losses, every.losses, rtol=1e-10, atol=0)
    assert every.bytes_per_step == 4 * no_sync.bytes_per_step
    assert no_sync.bytes_per_step == results["plain"].bytes_per_step


def test_fp16_halves_the_bytes_and_keeps_the_loss(results: dict) -> None:
    plain, fp16 = results["plain"], results["fp16"]
    assert fp16.bytes_per_step == plain.bytes_per_step / 8 * 2  # float64 gradients sent as 2-byte halves
    torch.testing.assert_close(fp16.losses, plain.losses, rtol=1e-3, atol=0)
    assert _differ(fp16, plain), "fp16 compression left the weights bit-identical: the hook did not run"


def test_powersgd_sends_far_less_and_keeps_the_loss(results: dict) -> None:
    plain, psgd = results["plain"], results["powersgd"]
    assert psgd.bytes_per_step < plain.bytes_per_step / 4
    torch.testing.assert_close(psgd.losses, plain.losses, rtol=2e-2, atol=0)
    assert _differ(psgd, plain)
