"""How a strategy's run is compared with its reference's: equal, refused before the first step in one line, or the
first difference, in one line."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tests.support.conformance.run import Strategy

Seen = dict[str, Any]

RTOL, ATOL = 1e-9, 1e-12


def first_difference(want: Any, got: Any, path: str = "", share: bool = False) -> str | None:
    """The first place where ``got`` is not ``want``, as one line; None when equal (floats and tensors to ``RTOL`` /
    ``ATOL``). ``share``: under a key ``held:...``, ``got`` may hold a subset of ``want``'s names (a pipeline rank's
    own parameters), each equal."""
    if isinstance(want, dict) and isinstance(got, dict):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        subset = share and "held:" in path
        if extra or (missing and not (subset and got)):
            return f"{path or '.'}: keys {missing[:3]} missing, {extra[:3]} extra"
        for key in (k for k in want if k in got):
            found = first_difference(want[key], got[key], f"{path}[{key!r}]" if path else key, share)
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{path}: {len(got)} entries, the reference has {len(want)} ({_short(got)} vs {_short(want)})"
        for i, (w, g) in enumerate(zip(want, got)):
            found = first_difference(w, g, f"{path}[{i}]", share)
            if found:
                return found
        return None
    if isinstance(want, Tensor) and isinstance(got, Tensor):
        if got.is_meta or want.is_meta:
            return f"{path}: a meta tensor {tuple(got.shape)}" if got.is_meta else f"{path}: the reference's is on meta"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{path}: {got.dtype} {tuple(got.shape)}, the reference's {want.dtype} {tuple(want.shape)}"
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True):
            diff = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item()
            return f"{path}: max |difference| {diff:.3g} ({_short(got)} vs {_short(want)})"
        return None
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        same = (math.isnan(want) and math.isnan(got)) or math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL)
        return None if same else f"{path}: {got!r}, the reference {want!r}"
    if type(want) is not type(got) or want != got:
        return f"{path}: {_short(got)}, the reference {_short(want)}"
    return None


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        value = value.flatten()[:3].tolist() if not value.is_meta else f"meta{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reference_for(rank: int, reference: list[Seen | None]) -> Seen | None:
    """The reference's rank ``rank``; a one-process reference's rank 0 for every rank (without what only rank 0 sees)."""
    if rank < len(reference):
        return reference[rank]
    first = reference[0]
    return None if first is None else {k: v for k, v in first.items() if not k.startswith("r0:")}


# what a refusal is never raised as: these are a strategy's own bug, whenever they come
_CRASHES = frozenset({"AttributeError", "KeyError", "IndexError", "AssertionError", "ZeroDivisionError", "UnboundLocalError",
                      "NameError", "RecursionError"})


def verdict(reference: list[Seen | None], got: list[Seen | None], strategy: Strategy) -> str:
    """``equal``, ``refused: <its line>`` (every rank that raised did so before any training batch, in one line), or
    what differs, in one line. A reference that failed is the suite's own error (AssertionError)."""
    refused = []
    for rank, seen in enumerate(got):
        want = _reference_for(rank, reference)
        if want is None or "error" in want:
            raise AssertionError(f"the reference run failed on rank {rank}: {want and want['error']}\n{want and want.get('traceback')}")
        if seen is None:
            if rank > 0 and got[0] is not None and got[0].get("prelaunch"):
                continue  # rank 0 refused before rank 1 existed
            return f"rank {rank} saved nothing"
        if "error" in seen:
            crashed = seen["error"].split(":", 1)[0] in _CRASHES
            if seen["refused"] and seen["lines"] == 1 and not crashed:
                refused.append(seen["error"])
                continue
            how = "after training began" if not seen["refused"] else "a crash, not a refusal" if crashed else "in several lines"
            return f"rank {rank}: {seen['error']} ({how})"
        found = first_difference(want, seen, share=strategy.holds_share)
        if found:
            return f"rank {rank}: {found}"
    return f"refused: {refused[0]}" if refused else "equal"
