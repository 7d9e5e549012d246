"""The host-optimizer checks L2L offload makes at set-up, and preflight makes before any work: plain optimizers in."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.offload.host_optimizer import PER_PARAMETER, check_delayed_optimizer, check_host_optimizer


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, device="meta"))]  # what preflight builds: no memory


def test_a_per_parameter_optimizer_passes_both_checks() -> None:
    for cls in (torch.optim.SGD, torch.optim.AdamW):
        optimizer = cls(_params(), lr=0.1)
        check_host_optimizer(optimizer)
        check_delayed_optimizer(optimizer)
    assert torch.optim.Adam in PER_PARAMETER and torch.optim.LBFGS not in PER_PARAMETER


def test_a_closure_based_optimizer_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy cannot run LBFGS on the host: .*use a per-parameter optimizer"):
        check_host_optimizer(torch.optim.LBFGS(_params()))


def test_capturable_and_a_rule_across_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Adam\(capturable=True\) is for CUDA-graph capture.*set capturable=False"):
        check_host_optimizer(torch.optim.Adam(_params(), capturable=True))

    class WholeModelSGD(torch.optim.SGD):  # a subclass may step with a rule across parameters
        pass

    with pytest.raises(ValueError, match=r"X\(delayed_update=True\) .*not WholeModelSGD; use one of SGD"):
        check_delayed_optimizer(WholeModelSGD(_params(), lr=0.1), owner="X")
