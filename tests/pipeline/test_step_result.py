"""The step result's float64 path: which values ride in it, bit for bit, and when the signature changes.

The 2-rank exchange itself (logs that come and go, a changed name, a non-number, on every
rank) is tested through the strategy: tests/strategies/test_gpipe_distributed.py.
"""

from __future__ import annotations


import pytest
import torch

from lightning_accel.pipeline.step_result import number_spec, step_signature, unpack_number
from tests.support.workers.step_result_worker import bits


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(1 / 3), torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(1 / 3, dtype=torch.bfloat16),
        torch.tensor([65504.0], dtype=torch.float16), torch.tensor(float("nan")), torch.tensor(-float("inf")),
        torch.tensor(2**53, dtype=torch.int64), torch.tensor([[-7]], dtype=torch.int32), 1 / 3, -(2**53), 0.0,
    ],
)
def test_a_step_number_rides_in_float64_and_comes_back_bit_for_bit(value):
    spec = number_spec(value)
    assert spec is not None
    assert bits(unpack_number(float(value), spec)) == bits(value)


@pytest.mark.parametrize(
    "value", [True, 2**53 + 1, torch.tensor(2**60), torch.ones(2), torch.tensor(1.0, requires_grad=True), "x", None]
)
def test_what_float64_cannot_hold_exactly_goes_as_an_object(value):
    assert number_spec(value) is None
    assert step_signature((torch.tensor(1.0), [("v", value, {})], False)) is None


def test_thestep_signature_changes_with_names_options_and_kinds_not_values():
    def result(name="a", value=1.0, kw=None):
        return (torch.tensor(2.0), [(name, torch.tensor(value), kw or {})], False)

    assert step_signature(result(value=1.0)) == step_signature(result(value=5.0))
    for other in (result(name="b"), result(kw={"prog_bar": True}), (torch.tensor(2.0), [], False), result()[:2] + (True,)):
        assert step_signature(other) != step_signature(result())
    assert step_signature((torch.tensor(2.0), [("a", torch.tensor(1.0, dtype=torch.float64), {})], False)) != (
        step_signature(result())
    )
