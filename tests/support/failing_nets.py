"""Networks that fail where no check before work can see: inside their forward, at the first training step."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_accel.models import GPT


class GPTFailingInForward(GPT):
    """The zoo GPT whose forward raises as a user's network might on data it cannot take (preflight builds it and
    compares its shapes with the data's, which fit; only running it shows the failure)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        raise ValueError(f"GPTFailingInForward got a batch of shape {tuple(idx.shape)} it was written to refuse; "
                         "fix the network's forward")
