"""What a user's hooks see under l2l_offload: every trainable parameter's gradient in ``on_after_backward`` and
``on_before_optimizer_step``, equal to plain Lightning's (float64, a transformers Llama), accumulation included.

Before, ``on_after_backward`` saw ``None`` for every offloaded block (their gradients had gone to the host), and with
the host step overlapping the backward (``overlap_step=True``, the default on a GPU) ``on_before_optimizer_step``
missed the blocks already stepped.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm

from lightning_accel import L2LOffloadStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_models import CausalLM, fit, real_task  # noqa: E402


class Watched(CausalLM):
    """Records, per hook call, every parameter's gradient (a copy) and Lightning's ``grad_norm``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__(net)
        self.seen: dict[str, list[dict[str, torch.Tensor | None]]] = {"after_backward": [], "before_step": []}
        self.norms: list[float] = []

    def _grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in self.named_parameters()}

    def on_after_backward(self) -> None:
        self.seen["after_backward"].append(self._grads())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen["before_step"].append(self._grads())
        self.norms.append(float(grad_norm(self, 2)["grad_2.0_norm_total"]))


def _watched() -> Watched:
    return Watched(real_task("llama", torch.float64).net).to(torch.float64)


@pytest.mark.parametrize("overlap_step", [None, True])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_hooks_see_plain_lightnings_gradients(accumulate: int, overlap_step: bool | None) -> None:
    plain, offload = _watched(), _watched()
    fit(plain, steps=2, accumulate_grad_batches=accumulate)
    fit(offload, L2LOffloadStrategy(overlap_step=overlap_step), steps=2, accumulate_grad_batches=accumulate)
    for hook in ("after_backward", "before_step"):
        assert len(offload.seen[hook]) == len(plain.seen[hook]) == (2 * accumulate if hook == "after_backward" else 2)
        for mine, theirs in zip(offload.seen[hook], plain.seen[hook]):
            assert mine.keys() == theirs.keys()
            for name in theirs:
                assert (mine[name] is None) == (theirs[name] is None), f"{hook}: {name}"
                if theirs[name] is not None:
                    torch.testing.assert_close(mine[name], theirs[name], rtol=1e-10, atol=1e-12, msg=f"{hook}: {name}")
    torch.testing.assert_close(offload.norms, plain.norms, rtol=1e-10, atol=0)


def test_the_gradients_shown_do_not_change_training() -> None:
    """Shown and taken back: the accumulation's next backward does not add into them twice (weights equal plain)."""
    plain, offload = _watched(), _watched()
    fit(plain, steps=2, accumulate_grad_batches=2)
    fit(offload, L2LOffloadStrategy(), steps=2, accumulate_grad_batches=2)
    for (name, a), b in zip(plain.state_dict().items(), offload.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)
