"""PrefetchTuner under DDP: each rank tunes its own shard within its share of the machine.

Two gloo ranks on the CPU, launched the way users launch them (Lightning re-runs the
script for rank 1). The per-rank budget is the machine's split by the ranks on it, and
a rebuild mid-epoch on either rank neither repeats nor drops a sample of the epoch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from lightning_accel.comm.rendezvous import held_store, store_env
from tests.support.warm_python import python as warm_python

WORKER = Path(__file__).with_name("tuner_ddp_worker.py")
SAMPLES = 64
HANG_S = 480  # 30 s alone, 98-183 s beside a load of 8-17 on 2 cores: only a hang takes this long
# Set by an in-process process group (some strategy tests) or a seeded run: a child that inherits LOCAL_RANK
# believes it was launched, a stale MASTER_PORT points it at another run's store, PL_GLOBAL_SEED reshuffles.
INHERITED = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.mark.slow
def test_each_rank_tunes_its_shard_within_its_share_and_loses_no_sample(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    store = held_store(HANG_S)
    env.update(store_env(store.port))
    # A session of its own: on a hang, rank 0, the rank Lightning launched and their loader workers go together
    # (killing rank 0 alone leaves rank 1 waiting on the store this test holds, and its pipes open).
    ranks = subprocess.Popen(
        [warm_python(), str(WORKER), str(tmp_path), str(SAMPLES)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, stderr = ranks.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(ranks.pid, signal.SIGKILL)
        _, stderr = ranks.communicate()
        pytest.fail(f"the ranks still ran after {HANG_S} s: a hang\n{stderr[-3000:]}")
    finally:
        del store
    assert ranks.returncode == 0, stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    seen = results[0]["indices"] + results[1]["indices"]
    assert sorted(seen) == list(range(SAMPLES))  # the two shards cover the epoch exactly once
    assert not set(results[0]["indices"]) & set(results[1]["indices"])

    for r in results:
        # 50 ms of I/O per item against a 5 ms step: data-bound on any machine, so each rank searched and chose workers.
        assert r["chosen_workers"] is not None and r["chosen_workers"] >= 1, r["reason"]
        assert r["budget_workers"] == max(1, 4 * (os.cpu_count() or 1) // 2)  # half the machine's cap
        assert max(r["tried_workers"]) <= r["budget_workers"]
        # Half of the free memory: against the whole machine's share measured by the rank itself, before and after
        # its fit (free memory moves with whatever else runs on the machine).
        low, high = sorted(r["whole_machine_bytes"])
        assert 0.3 * low < r["budget_bytes"] < 0.7 * high
