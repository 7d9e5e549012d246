"""PrefetchTuner under DDP: each rank tunes its own shard within its share of the machine.

Two gloo ranks on the CPU, launched the way users launch them (Lightning re-runs the
script for rank 1). The per-rank budget is the machine's split by the ranks on it, and
a rebuild mid-epoch on either rank neither repeats nor drops a sample of the epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel.prefetch.search import default_budget

WORKER = Path(__file__).with_name("tuner_ddp_worker.py")
SAMPLES = 64


@pytest.mark.slow
def test_each_rank_tunes_its_shard_within_its_share_and_loses_no_sample(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "WORLD_SIZE", "MASTER_", "NODE_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(SAMPLES)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    seen = ranks[0]["indices"] + ranks[1]["indices"]
    assert sorted(seen) == list(range(SAMPLES))  # the two shards cover the epoch exactly once
    assert not set(ranks[0]["indices"]) & set(ranks[1]["indices"])

    whole_machine = default_budget(None, None, 1)
    for r in ranks:
        # 30 ms of I/O per item against a 5 ms step: data-bound, so each rank searched and chose workers.
        assert r["chosen_workers"] is not None and r["chosen_workers"] >= 1, r["reason"]
        assert r["budget_workers"] == max(1, 4 * (os.cpu_count() or 1) // 2)  # half the machine's cap
        assert max(r["tried_workers"]) <= r["budget_workers"]
        assert 0.3 < r["budget_bytes"] / whole_machine.memory_bytes < 0.7  # half of the free memory
