"""Who holds which tensor of a split module, and the refusal of a second split for another layout (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.state_gather import load_own_state
from lightning_accel.pipeline.mesh import check_ranks_per_pipeline, check_world_size, ranks_per_pipeline
from lightning_accel.pipeline.placement import check_split, owners


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(8, 4), *(nn.Linear(4, 4) for _ in range(4)), nn.Linear(4, 8))
    return net


def test_owners_follow_the_stages_and_everything_outside_the_blocks_is_shared():
    net = _net()
    blocks = list(net[1:5])
    tensors = [*net.parameters()]
    # 4 stages on 2 ranks (interleaved): stage s on rank s % 2; blocks [1, 1, 1, 1]
    owned, shared = owners(tensors, blocks, [1, 1, 1, 1], 2)
    names = [n for n, _ in net.named_parameters()]
    by_name = dict(zip(names, zip(owned, shared)))
    assert by_name["1.weight"] == (0, False) and by_name["2.bias"] == (1, False)
    assert by_name["3.weight"] == (0, False) and by_name["4.weight"] == (1, False)
    assert by_name["0.weight"] == (1, True) and by_name["5.bias"] == (1, True)  # outside: the last stage's rank
    # V-wise (zbv, dualpipev): rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; outside: rank 0, the last stage's
    owned, shared = owners(tensors, blocks, [1, 1, 1, 1], 2, "zbv")
    by_name = dict(zip(names, zip(owned, shared)))
    assert [by_name[f"{k}.weight"] for k in range(1, 5)] == [(0, False), (1, False), (1, False), (0, False)]
    assert by_name["0.weight"] == (0, True) and by_name["5.bias"] == (0, True)


def test_a_second_split_must_keep_the_first_layout():
    choose = lambda: [2, 2]  # noqa: E731
    assert check_split(None, 2, "one", "gpipe", "by_size", 2, 4, choose) == [2, 2]
    assert check_split((2, "one", (3, 1)), 2, "one", "gpipe", "by_size", 2, 4, choose) == [3, 1]
    with pytest.raises(ValueError, match=r"split for 2 ranks with balance \[3, 1\] by an earlier run.*; build a fresh"):
        check_split((2, "one", (3, 1)), 1, "looped", "interleaved_1f1b", "by_size", 2, 4, choose)
    with pytest.raises(ValueError, match=r"balance \[2, 2\] differs from \[3, 1\], the split of this module"):
        check_split((2, "one", (3, 1)), 2, "one", "gpipe", [2, 2], 2, 4, choose)
    with pytest.raises(ValueError, match=r"schedule 'gpipe' on 2 ranks runs 2 stages but balance has 3"):
        check_split(None, 2, "one", "gpipe", [1, 1, 2], 2, 4, lambda: [1, 1, 2])
    # the same ranks and balance, the stages placed V-wise instead of looped: rank 1 holds other blocks
    with pytest.raises(ValueError, match=r"split for 2 ranks with balance \[1, 1, 1, 1\] by an earlier run.*'zbv'"):
        check_split((2, "looped", (1, 1, 1, 1)), 2, "v", "zbv", "by_size", 4, 4, choose)


def test_too_few_blocks_for_two_stages_per_rank_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^schedule 'zbv' on 2 ranks runs 4 stages \(2 per rank\) but the model has 3 "
                       r"blocks; give it at least 4 blocks, run fewer ranks, or choose a schedule with one stage per rank "
                       r"\('1f1b'\)$"):
        check_split(None, 2, "v", "zbv", "by_size", 4, 3, lambda: [1, 1, 1])


def test_ranks_per_pipeline_and_world_size():
    assert ranks_per_pipeline(None, [2, 2], 1, 8) == 2 and ranks_per_pipeline(None, [1, 1, 1, 1], 2, 8) == 2
    assert ranks_per_pipeline(None, "by_size", 1, 8) == 8 and ranks_per_pipeline(4, "by_size", 1, 8) == 4
    check_world_size(8, 4, "given", "S")
    with pytest.raises(ValueError, match=r"S: world size 6 is not a multiple of pipeline_parallel_size=4 \(ranks per "
                       r"pipeline, given\); run a multiple of 4 processes"):
        check_world_size(6, 4, "given", "S")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be a positive int \(ranks per pipeline\), got True"):
        check_ranks_per_pipeline(True, "by_size", 1, "gpipe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"balance \[1, 1\] has 2 stages but pipeline_parallel_size=2 ranks run 4"):
        check_ranks_per_pipeline(2, [1, 1], 2, "interleaved_1f1b")


def test_a_rank_loads_only_the_part_it_holds():
    whole, part = _net(), _net()
    for p in whole.parameters():
        p.data.add_(1.0)
    part[2].to("meta")
    assert load_own_state(part, whole.state_dict())
    assert torch.equal(part[1].weight, whole[1].weight) and part[2].weight.is_meta
    assert not load_own_state(_net(), whole.state_dict())  # nothing freed: the caller loads as usual
    with pytest.raises(RuntimeError, match=r"does not match this rank's part of the model: missing \['1.bias'\]"):
        load_own_state(part, {k: v for k, v in whole.state_dict().items() if k != "1.bias"})
