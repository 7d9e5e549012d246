"""Whether the whole module fits every host after fit (:mod:`lightning_accel.pipeline.whole_module`), on one rank."""

from __future__ import annotations

import torch

from lightning_accel.pipeline.whole_module import fits_every_host, placeholder_bytes


def test_placeholders_count_what_they_will_take_filled():
    tensors = [torch.empty(3, 4, device="meta"), torch.empty(5, dtype=torch.float64, device="meta"), torch.ones(100)]
    assert placeholder_bytes(tensors) == 3 * 4 * 4 + 5 * 8  # the real tensor is held already


def test_the_hosts_free_memory_decides_and_an_unknown_one_is_taken_to_fit(one_rank_group):
    assert fits_every_host(1000, 1000) and fits_every_host(1000, None) and fits_every_host(0, 0)
    assert not fits_every_host(1001, 1000)
