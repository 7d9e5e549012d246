"""Starting the conformance workers: one launch per strategy, all side by side, the remaining features started again in
fresh processes after a hang or a crash, so one broken cell never hides the others."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightning_accel.comm.rendezvous import held_store, store_env
from tests.support.conformance.run import HANG_S, STRATEGIES
from tests.support.warm_python import python as warm_python
from tests.support.workers import WORKERS

Results = dict[str, list[dict[str, Any] | None]]  # feature -> what each rank saved (None: nothing)
_ROOT = Path(__file__).resolve().parents[3]


def _env(port: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CONFORMANCE_START"):
        env.pop(var, None)  # a fresh launch, not a rank of some outer job
    env.update(store_env(port))
    return env


def _launch(out: Path, strategy: str, features: Sequence[str], log: Path) -> int:
    """One worker launch over ``features``; its whole process group is killed when rank 0 ends or runs past the
    features' watchdogs."""
    store = held_store(HANG_S)
    with open(log, "w") as sink:
        proc = subprocess.Popen([warm_python(), str(WORKERS / "conformance_worker.py"), str(out), strategy, ",".join(features)],
                                env=_env(store.port), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=HANG_S * (len(features) + 2))
        except subprocess.TimeoutExpired:
            code = -9
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1, if rank 0 left it behind
        except ProcessLookupError:
            pass
        proc.wait()
    del store
    return code


def _load(out: Path, feature: str, world: int) -> list[dict[str, Any] | None]:
    ranks = [out / f"{feature}-rank{r}.pt" for r in range(world)]
    return [torch.load(p, weights_only=False) if p.is_file() else None for p in ranks]


def _complete(saved: list[dict[str, Any] | None]) -> bool:
    """Every rank saved, or rank 0 ended it before rank 1 existed."""
    first = saved[0]
    return first is not None and (all(s is not None for s in saved) or bool(first.get("prelaunch")))


def run_strategy(out: Path, strategy: str, features: Sequence[str]) -> Results:
    """Every feature under ``strategy``; a launch that ends early is recorded against the feature it was in (each rank
    that saved nothing: ``error: the process ended ...``), and the rest are launched again."""
    out.mkdir(parents=True, exist_ok=True)
    world = STRATEGIES[strategy].devices
    remaining, attempt = list(features), 0
    while remaining:
        log = out / f"launch-{attempt}.log"
        code = _launch(out, strategy, remaining, log)
        attempt += 1
        cut = next((i for i, f in enumerate(remaining) if not _complete(_load(out, f, world))), None)
        if cut is None:
            break
        feature = remaining[cut]
        started = any((out / f"{feature}-rank{r}.started").is_file() for r in range(world))
        if started or cut == 0:  # it ended in this feature (or, having started none, in its start): recorded, skipped
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
            for rank, saved in enumerate(_load(out, feature, world)):
                if saved is None:
                    torch.save({"error": f"the process ended (exit status {code}) without saving: {tail}", "lines": 1,
                                "refused": False, "prelaunch": False}, out / f"{feature}-rank{rank}.pt")
            cut += 1
        remaining = remaining[cut:]  # a feature no rank started (the peer died between two) runs in the next launch
    return {f: _load(out, f, world) for f in features}


def run_all(out: Path, strategies: Sequence[str], features: Sequence[str]) -> dict[str, Results]:
    """``run_strategy`` for each strategy, side by side (a 2-rank run mostly waits on its peer)."""
    with ThreadPoolExecutor(max_workers=len(strategies) or 1) as pool:
        futures = {s: pool.submit(run_strategy, out / s, s, features) for s in strategies}
        return {s: f.result() for s, f in futures.items()}
