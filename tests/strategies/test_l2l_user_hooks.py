"""What a user's hooks see under l2l_offload: every trainable parameter's gradient in ``on_after_backward`` and
``on_before_optimizer_step``, equal to plain Lightning's (float64, a transformers Llama), accumulation included.

Before, ``on_after_backward`` saw ``None`` for every offloaded block (their gradients had gone to the host), and with
the host step overlapping the backward (``overlap_step=True``, the default on a GPU) ``on_before_optimizer_step``
missed the blocks already stepped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import grad_norm

from lightning_accel import L2LOffloadStrategy
from tests.support.real_models import CausalLM, fit, real_task
from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS


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


# -- l2l_offload_ddp on 2 gloo ranks against Lightning's DDP ------------------------------------------------------------

HOOK_CASES = [f"gpt64-{how}-hooks{acc}" for acc in ("", "-acc") for how in ("ddp", "part", "repl")]


@pytest.fixture(scope="module")
def two_ranks_hooks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("l2l_ddp_hooks")
    result = run_user_script(WORKERS / "l2l_ddp_worker.py", [str(out), "2", ",".join(HOOK_CASES)], 600, "2-process hooks")
    assert result.returncode == 0, result.stdout[-4000:]
    return out, result.stdout


def _ranks(out: Path, case: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{case}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("acc", ["", "-acc"], ids=["each-batch", "accumulate-2"])
@pytest.mark.parametrize("how", ["part", "repl"])
def test_data_parallel_hooks_see_what_ddp_shows(two_ranks_hooks: tuple[Path, str], how: str, acc: str) -> None:
    """on_after_backward under l2l_offload_ddp shows DDP's gradients: averaged over the ranks after the backward that
    ends an accumulation (replicated: every one; partitioned: the rank's own blocks and the device parameters, the
    other rank's blocks None), the rank's own sums inside an accumulation; strategy.grad_norm(2) there equals
    Lightning's grad_norm under DDP. Before: None for every block, the device parameters' not yet averaged."""
    out, _ = two_ranks_hooks
    ddp, mine = _ranks(out, f"gpt64-ddp-hooks{acc}"), _ranks(out, f"gpt64-{how}-hooks{acc}")
    host = set(mine[0]["owned"]) | set(mine[1]["owned"])
    for rank in range(2):
        theirs, got = ddp[rank]["after_backward"], mine[rank]["after_backward"]
        assert len(got) == len(theirs) == 4  # one call per batch
        for call, (want, seen) in enumerate(zip(theirs, got)):
            averaged = not acc or call % 2 == 1
            assert seen.keys() == want.keys()
            for name, grad in want.items():
                assert grad is not None, name
                if how == "part" and averaged and name in host and name not in mine[rank]["owned"]:
                    assert seen[name] is None, f"call {call}: {name} is rank {1 - rank}'s"
                else:
                    assert seen[name] is not None, f"call {call}: {name}"
                    torch.testing.assert_close(seen[name], grad, rtol=0, atol=1e-12, msg=f"rank {rank} call {call}: {name}")
        torch.testing.assert_close(mine[rank]["after_backward_norms"], ddp[rank]["after_backward_norms"], rtol=1e-10, atol=0)
        # shown, not changed: the step's gradient norm and the weights after fit are DDP's
        torch.testing.assert_close(mine[rank]["norms"], ddp[rank]["norms"], rtol=1e-10, atol=0)
        for name, weight in ddp[0]["weights"].items():
            torch.testing.assert_close(mine[rank]["weights"][name], weight, rtol=0, atol=1e-12, msg=name)


@pytest.mark.slow
def test_partitioned_step_says_once_what_a_rank_holds(two_ranks_hooks: tuple[Path, str]) -> None:
    from lightning_accel.strategies.l2l_offload_ddp import PARTITIONED_HOOKS_NOTICE

    _, said = two_ranks_hooks
    assert said.count(PARTITIONED_HOOKS_NOTICE) == 1  # rank 0 only, once
