"""Start a benchmark's worker as two gloo ranks on this machine and collect what rank 0 reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from lightning_accel.comm.rendezvous import held_store, store_env


def run_two_ranks(argv: list[str], timeout: float) -> list[str]:
    """Run ``python argv`` as ranks 0 and 1 (one thread each, meeting in a store this process holds) and return each rank's output.

    One deadline covers both ranks; past it both are killed. A rank that fails raises with the tail of
    every rank's output, since a pipeline's failure often shows on the neighbour first.
    """
    store = held_store(timeout)
    procs = []
    for rank in range(2):
        env = dict(os.environ, **store_env(store.port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"the 2 pipeline ranks did not finish within --timeout {timeout} s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError("a pipeline rank failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return outputs


def rank_result(output: str) -> Any:
    """The JSON a worker printed on its ``RESULT `` line."""
    line = next(ln for ln in output.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
