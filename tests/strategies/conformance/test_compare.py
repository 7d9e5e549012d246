"""The conformance verdict can fail: a weight off by more than rounding, a refusal after training began or in several
lines, a pipeline rank's missing gradients where the strategy holds the whole model, are each told in one line."""

from __future__ import annotations

import torch

from tests.support.conformance.compare import first_difference, verdict
from tests.support.conformance.run import STRATEGIES

SEEN = {"r0:weights": {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}, "hooks": {"on_train_batch_start": 4},
        "held:grads": [{"a": torch.ones(2), "b": torch.zeros(2)}], "lr": 0.5}


def _with(**changes: object) -> dict[str, object]:
    return {**SEEN, **changes}


def test_equal_runs_and_rounding_are_equal() -> None:
    rounded = _with(**{"r0:weights": {"w": torch.tensor([1.0 + 1e-14, 2.0], dtype=torch.float64)}})
    assert verdict([SEEN], [rounded], STRATEGIES["gpipe"]) == "equal"


def test_a_difference_is_named_by_its_path_and_size() -> None:
    off = _with(**{"r0:weights": {"w": torch.tensor([1.0, 2.001], dtype=torch.float64)}})
    assert verdict([SEEN], [off], STRATEGIES["gpipe"]).startswith("rank 0: r0:weights['w']: max |difference| 0.001")
    assert verdict([SEEN], [_with(hooks={"on_train_batch_start": 8})], STRATEGIES["gpipe"]) == (
        "rank 0: hooks['on_train_batch_start']: 8, the reference 4")
    assert first_difference(SEEN, _with(lr=0.25)) == "lr: 0.25, the reference 0.5"
    meta = _with(**{"r0:weights": {"w": torch.empty(2, dtype=torch.float64, device="meta")}})
    assert verdict([SEEN], [meta], STRATEGIES["gpipe"]) == "rank 0: r0:weights['w']: a meta tensor (2,)"


def test_a_one_process_reference_stands_for_every_rank_without_rank_zeros_keys() -> None:
    rank1 = {k: v for k, v in SEEN.items() if not k.startswith("r0:")}
    assert verdict([SEEN], [SEEN, rank1], STRATEGIES["gpipe_distributed"]) == "equal"
    assert verdict([SEEN], [SEEN, {**rank1, "lr": 0.1}], STRATEGIES["gpipe_distributed"]) == "rank 1: lr: 0.1, the reference 0.5"
    assert verdict([SEEN], [SEEN, SEEN], STRATEGIES["gpipe_distributed"]) == "rank 1: .: keys [] missing, ['r0:weights'] extra"


def test_only_a_strategy_holding_a_share_may_show_some_gradients() -> None:
    share = _with(**{"held:grads": [{"a": torch.ones(2)}]})
    assert verdict([SEEN], [share], STRATEGIES["gpipe_distributed"]) == "equal"
    assert verdict([SEEN], [share], STRATEGIES["gpipe"]) == "rank 0: held:grads[0]: keys ['b'] missing, [] extra"
    none = _with(**{"held:grads": [{}]})
    assert verdict([SEEN], [none], STRATEGIES["gpipe_distributed"]).startswith("rank 0: held:grads[0]: keys ['a', 'b'] missing")


def test_a_refusal_counts_only_before_the_first_batch_and_in_one_line() -> None:
    refused = {"error": "ValueError: no; do this", "lines": 1, "refused": True, "prelaunch": False}
    assert verdict([SEEN], [refused], STRATEGIES["l2l_offload"]) == "refused: ValueError: no; do this"
    late = {**refused, "refused": False}
    assert verdict([SEEN], [late], STRATEGIES["l2l_offload"]) == "rank 0: ValueError: no; do this (after training began)"
    long = {**refused, "lines": 3}
    assert verdict([SEEN], [long], STRATEGIES["l2l_offload"]) == "rank 0: ValueError: no; do this (in several lines)"
    prelaunch = {**refused, "prelaunch": True}
    assert verdict([SEEN, SEEN], [prelaunch, None], STRATEGIES["l2l_offload_ddp"]).startswith("refused: ")
    assert verdict([SEEN, SEEN], [SEEN, None], STRATEGIES["l2l_offload_ddp"]) == "rank 1 saved nothing"
    crash = {**refused, "error": "AttributeError: Ordered has no attribute `blocks`"}
    assert verdict([SEEN], [crash], STRATEGIES["l2l_offload"]) == (
        "rank 0: AttributeError: Ordered has no attribute `blocks` (a crash, not a refusal)")
