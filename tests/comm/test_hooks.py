"""CommHookSpec: bad hook settings are refused up front, with the fix."""

from __future__ import annotations

import pytest

from lightning_accel.comm import CommHookSpec, check_comm_hook
from lightning_accel.config.errors import UserError


def test_unknown_hook_names_the_close_match() -> None:
    with pytest.raises(UserError, match=r"comm_hook='fp61' is not a DDP communication hook \(did you mean 'fp16'\?\).*strategy=ddp_fp16"):
        CommHookSpec("fp61")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "powersgd", "powersgd_rank": 0}, r"powersgd_rank=0 must be >= 1"),
        ({"name": "powersgd", "powersgd_start_iter": 1}, r"powersgd_start_iter=1 must be >= 2"),
        ({"name": "fp16", "powersgd_fp16": True}, r"powersgd_fp16=true only applies to comm_hook=powersgd, not 'fp16'"),
    ],
)
def test_bad_powersgd_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        CommHookSpec(**kwargs)


def test_bf16_hook_needs_nccl() -> None:
    with pytest.raises(UserError, match=r"comm_hook=bf16 needs CUDA with NCCL >= 2.10.*accelerator is cpu.*strategy=ddp_fp16"):
        check_comm_hook(CommHookSpec("bf16"), device_type="cpu")
    check_comm_hook(CommHookSpec("bf16"), device_type="cuda")
    check_comm_hook(CommHookSpec("fp16"), device_type="cpu")
