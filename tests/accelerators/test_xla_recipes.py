"""The TPU recipes, shrunk, end to end on the CPU PJRT device through the CLI."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.xla, pytest.mark.slow]

# the GPT recipes shrunk to one tiny layer on short sequences, 20 steps
_GPT_SHRUNK = [
    "trainer.max_steps=20",
    "trainer.val_check_interval=10",
    "model.net.preset=tiny",
    "+model.net.n_layer=1",
    "data.block_size=32",
    "data.batch_size=8",
    "data.num_workers=0",
]
SHRINK = {
    "resnet-tiny_1tpu": [
        "trainer.max_steps=10",
        "trainer.val_check_interval=5",
        "data.batch_size=8",
        "data.image_size=16",
        "data.train_samples=256",
        "data.val_samples=32",
    ],
    # OneCycleLR needs pct_start x max_steps >= 1 warm-up step: 20 steps at pct_start 0.1.
    "gpt-small_bf16_1tpu": _GPT_SHRUNK,
    # The 4-chip SPMD recipe on 2 CPU PJRT devices (CPU_NUM_DEVICES below): global batch 8 = 4 + 4.
    "gpt-small_bf16-spmd_4tpu": ["trainer.devices=2", *_GPT_SHRUNK],
}
CPU_DEVICES = {"gpt-small_bf16-spmd_4tpu": "2"}  # CPU_NUM_DEVICES for the run (default 1)


@pytest.mark.parametrize("recipe", sorted(SHRINK))
def test_tpu_recipe_runs_shrunk_on_cpu_pjrt(recipe: str, cli_env: dict[str, str], xla_cpu_available: None) -> None:
    overrides = [*SHRINK[recipe], "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_accel", "run", recipe, *overrides],
        env={**cli_env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": CPU_DEVICES.get(recipe, "1")},
        capture_output=True,
        text=True,
        timeout=600,  # generous: CI runs this lane at nice 19 beside the main one, which may hold both cores
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"lightning-accel: {recipe} finished" in out
    assert "xla: " in out and "graphs compiled" in out
    if "gpt" in recipe:
        assert "DevicePrefetcher: torch_xla's MpDeviceLoader copies the next batches to xla:0" in out
    if recipe in CPU_DEVICES:
        assert f"xla_pjrt: data parallel over {CPU_DEVICES[recipe]} PJRT devices by SPMD in one process" in out
    status = json.loads(next(Path(cli_env["LIGHTNING_ACCEL_OUTPUTS"]).glob(f"{recipe}/*/run.json")).read_text())
    assert status["status"] == "completed" and status["metrics"]["val/loss"] > 0
    rows = list(csv.DictReader(open(status["metrics_csv"])))
    assert any(row.get("xla/compilations") for row in rows)
