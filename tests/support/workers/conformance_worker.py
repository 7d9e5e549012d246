"""A user script running conformance features under one strategy, one after another in the same process(es).

Run as ``python conformance_worker.py OUT_DIR STRATEGY FEATURE[,FEATURE...]``
(:data:`tests.support.conformance.STRATEGIES`, :data:`tests.support.conformance.FEATURES`). Lightning's launcher
re-runs it for rank 1 of a 2-process strategy, at the first fit that launches; that rank starts at the feature rank 0
was in (:data:`START_ENV`, inherited), since what came before ended on rank 0 before any rank 1 existed.

Each feature saves ``OUT_DIR/FEATURE-rank{r}.pt`` when it ends: what it saw (:class:`tests.support.conformance.Run`), or
the exception that ended it (``error``: one line; ``lines``: how many its message has; ``refused``: raised before any
training batch began; ``prelaunch``: before rank 1 existed), and ``FEATURE-rank{r}.seconds`` how long it took; at
the end each rank writes the CPU seconds it used (``cpu-rank{r}-{pid}.seconds``: CI's budget is CPU on 2 cores). A
:class:`Watchdog` saves ``error: hung ...`` and exits the process when no rank makes progress; the test's launcher starts
the remaining features in fresh processes. After each feature of a launched world the ranks meet in the launcher's store (a key each), not in a
collective, which a broken process group could not run; a rank whose peer died exits there.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore

from tests.support.conformance import FEATURES, STRATEGIES, Run
from tests.support.conformance.run import HANG_S, IDLE_S

START_ENV = "CONFORMANCE_START"
BUSY_CPU_S = 0.02  # CPU seconds a rank spends in a 0.5 s tick while it computes (a blocked one: ~3 ms, its threads)


def result_path(out: Path, feature: str, rank: int) -> Path:
    return out / f"{feature}-rank{rank}.pt"


def _save(out: Path, feature: str, rank: int, seen: dict[str, Any]) -> None:
    tmp = result_path(out, feature, rank).with_suffix(".tmp")
    torch.save(seen, tmp)
    tmp.replace(result_path(out, feature, rank))


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def run_feature(name: str, strategy: str, out: Path) -> dict[str, Any]:
    run = Run(strategy, out / "work" / name)  # one directory for every rank, as a user's run has
    run.root.mkdir(parents=True, exist_ok=True)
    try:
        FEATURES[name](run)
    except Exception as err:  # noqa: BLE001 - what the feature's user would have got, kept as data
        return {"error": _one_line(err), "lines": len(str(err).strip().splitlines()), "refused": not run.started(),
                "prelaunch": "LOCAL_RANK" not in os.environ, "traceback": traceback.format_exc()[-3000:]}
    return run.seen


class Watchdog:
    """Ends this process when the running feature makes no progress for ``IDLE_S`` (every rank blocked on another: a
    hang, told in seconds whatever the machine's load) or runs past ``HANG_S``, after saving the feature's result on this
    rank: ``error: hung ...`` and where the main thread was. A rank makes progress in a tick when its main thread is
    runnable (``R`` in /proc: computing, or waiting for a core on a loaded machine) or spent CPU; each rank counts its
    ticks of progress in the launcher's store, so a rank waiting on a busy peer is not taken for hung, nor is a rank
    waiting for its peer to start (judged only once every rank is alive)."""

    def __init__(self, out: Path, rank: int, world: int) -> None:
        self.out, self.rank, self.world = out, rank, world
        self.store = _client() if world > 1 else None
        if self.store is not None:
            self.store.set(f"alive/{rank}", "1")
        self.main, self.main_tid = threading.main_thread(), threading.get_native_id()  # built on the main thread
        self.feature: str | None = None
        self.lock = threading.Lock()
        self.cpu, self.ticks = time.process_time(), 0
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, feature: str) -> None:
        with self.lock:
            self.feature, self.started, self.busy, self.seen = feature, time.monotonic(), time.monotonic(), self._progress()

    def stop(self) -> None:
        with self.lock:
            self.feature = None

    def _working(self) -> bool:
        cpu, self.cpu = self.cpu, time.process_time()
        with open(f"/proc/self/task/{self.main_tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state == "R" or self.cpu - cpu > BUSY_CPU_S

    def _progress(self) -> int:
        """Ticks of progress of every rank so far (this one's counted now)."""
        mine = 1 if self._working() else 0
        if self.store is None:
            self.ticks += mine
            return self.ticks
        self.store.add(f"progress/{self.rank}", mine)
        if not self.store.check([f"alive/{r}" for r in range(self.world)]):
            return -time.monotonic_ns()  # a rank is still starting: always "progress"
        return sum(self.store.add(f"progress/{r}", 0) for r in range(self.world))

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                progress = self._progress()
                if self.feature is None:
                    continue
                now = time.monotonic()
                if progress != self.seen:
                    self.busy, self.seen = now, progress
                if now - self.busy > IDLE_S or now - self.started > HANG_S:
                    self._hung(self.feature, now - self.busy > IDLE_S)

    def _hung(self, feature: str, idle: bool) -> None:
        frames = traceback.extract_stack(sys._current_frames()[self.main.ident])
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-10:]))
        why = f"no rank made progress for {IDLE_S:.0f} s" if idle else f"still running after {HANG_S:.0f} s"
        _save(self.out, feature, self.rank, {"error": f"hung: {why}, at {where}", "lines": 1, "refused": False, "prelaunch": False})
        sys.stdout.flush()
        os._exit(3)


def _client() -> TCPStore:
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=HANG_S))


def _meet(store: TCPStore, feature: str, rank: int, world: int) -> None:
    store.set(f"{feature}/{rank}", "done")
    store.wait([f"{feature}/{r}" for r in range(world)], timedelta(seconds=HANG_S))


def main() -> None:
    out, strategy, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # Lightning's advice (num_workers, ...): alike in every run, not what is compared
    for logger in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_accel"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = STRATEGIES[strategy].devices
    store = _client() if world > 1 else None
    dog = Watchdog(out, rank, world)
    if rank != 0:
        names = names[names.index(os.environ[START_ENV]):]
    for name in names:
        if "LOCAL_RANK" not in os.environ:
            os.environ[START_ENV] = name  # rank 1, if this feature launches it, starts here
        result_path(out, name, rank).with_suffix(".started").touch()
        dog.start(name)
        began = time.perf_counter()
        seen = run_feature(name, strategy, out)
        dog.stop()
        result_path(out, name, rank).with_suffix(".seconds").write_text(f"{time.perf_counter() - began:.3f}")
        _save(out, name, rank, seen)
        if store is not None and "LOCAL_RANK" in os.environ:
            try:
                _meet(store, f"conformance/{name}", rank, world)
            except Exception:  # noqa: BLE001 - the peer died: the launcher starts the rest again
                sys.stdout.flush()
                os._exit(4)
    (out / f"cpu-rank{rank}-{os.getpid()}.seconds").write_text(f"{time.process_time():.3f}")  # CI's budget is CPU on 2 cores
    sys.stdout.flush()
    os._exit(0)  # past Lightning's process observer and gloo's teardown: the results are saved


if __name__ == "__main__":
    main()
