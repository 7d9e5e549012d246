"""A user script running :mod:`tests.support.lightning_features` under ``DistributedGPipeStrategy`` on 2 CPU processes.

Run as ``python lightning_features_worker.py OUT_DIR CASES``: Lightning's launcher starts rank 1 from it; CASES is a
comma-separated list of :data:`~tests.support.lightning_features.CASES` names, each one fit and what follows it in the
same two processes (start-up paid once). Every rank saves what it saw as ``{case}-rank{r}.pt``; rank 0 also writes
``{case}-2.ckpt``. ``no_room`` runs with the host's free memory said to be 1 byte (:func:`no_room`). Blocks: the three layers with weights (``net.0``, ``net.2``, ``net.4``), rank 0 holding the first.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any
from unittest import mock

import torch
from torch import nn

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.lightning_features import CASES, fit_case, probe, run_case, state_of


def no_room(strategy: DistributedGPipeStrategy, out: str) -> dict[str, Any]:
    """A fit whose strategy is told the host has 1 byte free: what each rank holds and was told after it, then after
    ``trainer.strategy.gather_module()``."""
    with mock.patch("lightning_accel.strategies.gpipe_split_state.available_host_bytes", lambda: 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, model, _ = fit_case("no_room", strategy, 2, out)
    said = [str(w.message) for w in caught if "gather_module" in str(w.message)]
    placeholders = sorted(n for n, t in model.state_dict().items() if t.is_meta)
    trainer.strategy.gather_module()
    return {"said": said, "placeholders": placeholders, "state": state_of(model), "probe": model(probe()).detach()}


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    for case in cases:
        strategy = DistributedGPipeStrategy(
            chunks=CASES[case][0], balance=[1, 2], blocks=lambda net: [m for m in net if not isinstance(m, nn.Tanh)],
            timeout=60,
        )
        seen = no_room(strategy, out) if case == "no_room" else run_case(case, strategy, 2, out)
        torch.save(seen, os.path.join(out, f"{case}-rank{int(os.environ.get('LOCAL_RANK', '0'))}.pt"))


if __name__ == "__main__":
    main()
