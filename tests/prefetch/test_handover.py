"""The hand-over lead: worked examples of the arithmetic in handover_lead's docstring."""

from __future__ import annotations

import pytest

from lightning_accel.prefetch.handover import handover_lead


def test_io_bound_items_from_no_workers_hand_over_after_one_batch():
    # Seed 004: 0.54 s per item in-process (mostly sleeping), 0.1 s step, 8 new workers on 2 cores.
    # One more batch from the old loader (0.64 s) covers a new worker's first item (0.54 s).
    assert handover_lead(0, 0.54, 8, 0.1, cores=2, cpu_share=0.05) == 1


def test_cpu_bound_items_wait_for_the_crowded_cores():
    # Same timings, but items need the CPU: 8 workers on 2 cores make their first items
    # 4x slower, so the old loader serves floor(1.1 * 0.54 * 4 / 0.64) = 3 batches meanwhile.
    assert handover_lead(0, 0.54, 8, 0.1, cores=2, cpu_share=1.0) == 3
    assert handover_lead(0, 0.54, 8, 0.1, cores=2) == 3  # unknown share: the cautious value


def test_from_workers_the_lead_counts_in_the_current_pace():
    # 2 workers, one batch every 0.3 s (an item takes 0.6 s), 0.1 s step: the pace is 0.3 s,
    # so floor(1.1 * 0.6 / 0.3) = 2 batches; bounded by max_lead.
    assert handover_lead(2, 0.3, 4, 0.1, cores=8) == 2
    assert handover_lead(2, 30.0, 64, 0.1, cores=1, max_lead=16) == 16


def test_unmeasured_current_loader_uses_the_step_as_its_item_time():
    assert handover_lead(0, None, 2, 0.1, cores=2) == 1


def test_the_new_workers_start_up_lengthens_the_lead():
    # Seed 004 again, but 8 workers take 80 ms each to start (a loaded 2-core machine): their first
    # batch comes 0.64 + 0.54 s after the prepare, so floor(1.1 * 1.18 / 0.64) = 2 batches, not 1.
    assert handover_lead(0, 0.54, 8, 0.1, cores=2, cpu_share=0.05, start_s=8 * 0.08) == 2
    assert handover_lead(0, 0.54, 8, 0.1, cores=2, cpu_share=0.05, start_s=0.0) == 1


def test_worker_start_time_is_measured_at_each_start():
    from torch.utils.data import DataLoader

    from lightning_accel.prefetch.inner_loader import _Inner, worker_start_s
    from lightning_accel.prefetch.settings import LoaderSettings

    inner = _Inner(DataLoader(list(range(4)), batch_size=2), LoaderSettings(2, 2), None)
    before = worker_start_s()
    inner.start()
    try:
        measured = worker_start_s()
        assert measured != before and 0 < measured < 5.0  # forking one worker: milliseconds, not seconds
        assert 2 * measured == pytest.approx(inner.started_at - inner.began)
    finally:
        inner.close()
