"""``lightning-accel estimate RECIPE --measure STEPS``: a run's max_memory_allocated beside each rank's device figure.

Without a GPU the run itself cannot happen here: the callback, the overrides the run gets, the pairing of devices
with ranks and the command's exit status are checked with a stand-in for the run; the real run is the ``cuda`` test
below and ``scripts/gpu-verify.sh run estimate``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from lightning_accel.cli import main
from lightning_accel.config.preflight import preflight
from lightning_accel.estimate import measure
from lightning_accel.estimate.components import RankEstimate
from lightning_accel.estimate.report import Estimate


def _estimate(*ranks: tuple[str, int, int]) -> Estimate:
    return Estimate("r", "gpipe_distributed", [RankEstimate(kind, count, device={"activations": nbytes}) for kind, count, nbytes in ranks],
                    device_memory=None, host_memory=None, on_cpu=False)


def _run(rank: int, **peaks: int) -> dict[str, Any]:
    return {"rank": rank, "peaks": {d.replace("_", ":"): {"allocated": b, "reserved": b + 1} for d, b in peaks.items()}}


def test_devices_pair_with_ranks_in_rank_order() -> None:
    rows = measure.compare(_estimate(("stage 0", 1, 1000), ("stage 1", 1, 2000)), [_run(1, cuda_1=2100), _run(0, cuda_0=1050)])
    assert [(r.kind, r.rank, r.device, r.estimate, r.allocated) for r in rows] == [("stage 0", 0, "cuda:0", 1000, 1050), ("stage 1", 1, "cuda:1", 2000, 2100)]
    assert all(r.within for r in rows)
    assert "within 10% of max_memory_allocated on every device" in measure.format_rows(rows)


def test_one_process_with_two_devices_and_a_device_off_by_more_than_the_goal() -> None:
    rows = measure.compare(_estimate(("stage 0", 1, 1000), ("stage 1", 1, 1000)), [_run(0, cuda_1=1500, cuda_0=1000)])
    assert [r.device for r in rows] == ["cuda:0", "cuda:1"] and [r.within for r in rows] == [True, False]
    assert "OUTSIDE 10% of max_memory_allocated on rank 0 cuda:1" in measure.format_rows(rows)


def test_a_run_on_fewer_devices_than_the_estimate_is_refused() -> None:
    with pytest.raises(ValueError, match="the run used 1 CUDA device"):
        measure.compare(_estimate(("rank", 4, 1000)), [_run(0, cuda_0=1000)])


def test_the_measured_run_passes_the_recipe_checks_and_its_callback_writes_each_rank(tmp_path: Path) -> None:
    overrides = measure.measure_overrides(3, str(tmp_path))
    cfg = preflight("gpt-small_bf16-accum_1gpu", overrides, launch=False)
    assert cfg.trainer.max_steps == 3
    callback = instantiate(cfg.callbacks.estimate_device_peak)
    assert isinstance(callback, measure.DevicePeak)
    trainer = SimpleNamespace(global_rank=1)
    callback.setup(trainer, None, "fit")
    callback.on_train_end(trainer, None)
    written = json.loads((tmp_path / "rank1.json").read_text())
    assert written["rank"] == 1
    assert written["peaks"] == {} if not torch.cuda.is_available() else all(p["allocated"] > 0 for p in written["peaks"].values())


def test_measure_refuses_without_a_gpu_before_estimating(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["estimate", "gpt-small_bf16-accum_1gpu", "--measure", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _stand_in_run(monkeypatch: pytest.MonkeyPatch, measured: float) -> dict[str, Any]:
    """The command's run stood in for: the estimate's own device peak, scaled by ``measured``, as the measurement."""
    seen: dict[str, Any] = {}

    def fake_run(recipe: str, overrides: list[str], steps: int) -> list[dict[str, Any]]:
        seen.update(recipe=recipe, overrides=overrides, steps=steps)
        return [_run(0, cuda_0=int(seen["peak"] * measured))]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "run_and_measure", fake_run)
    from lightning_accel.estimate import recipe as recipe_module

    real_estimate = recipe_module.estimate_recipe

    def estimate_and_note(*args: Any, **kwargs: Any) -> Estimate:
        estimate = real_estimate(*args, **kwargs)
        seen["peak"] = estimate.device_peak
        return estimate

    monkeypatch.setattr("lightning_accel.estimate.estimate_recipe", estimate_and_note)
    return seen


MEASURED_ARGS = ["gpt-small_bf16-accum_1gpu", "data.batch_size=2", "data.block_size=32", "--device-memory", "L4", "--measure", "3"]


@pytest.mark.parametrize(("measured", "status"), [(1.05, 0), (1.5, 1)])
def test_measure_prints_both_figures_and_exits_1_outside_the_goal(
    measured: float, status: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command end to end with the run stood in for."""
    seen = _stand_in_run(monkeypatch, measured)
    assert main(["estimate", *MEASURED_ARGS]) == status
    out = capsys.readouterr().out
    assert seen["recipe"] == "gpt-small_bf16-accum_1gpu" and seen["overrides"] == ["data.batch_size=2", "data.block_size=32"] and seen["steps"] == 3
    assert "max_memory_allocated" in out and f"{1 / measured:.3f}" in out
    assert "of 25.77 GB (--device-memory): fits" in out  # an accelerator named for the verdict
    assert ("OUTSIDE 10%" in out) == (status == 1)


def test_measure_with_json_prints_one_json_document(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # before, the table was printed ahead of the JSON, so scripts could not parse --json --measure's output
    _stand_in_run(monkeypatch, 1.05)
    assert main(["estimate", *MEASURED_ARGS, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [round(row["ratio"], 3) for row in printed["measured"]] == [round(1 / 1.05, 3)] and printed["ranks"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_run_reports_every_device_of_its_ranks(tmp_path: Path) -> None:
    from lightning_accel.estimate import estimate_recipe

    overrides = ["data.batch_size=4", "data.block_size=64", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    estimate = estimate_recipe("gpt-small_bf16-accum_1gpu", overrides)
    rows = measure.compare(estimate, measure.run_and_measure("gpt-small_bf16-accum_1gpu", overrides, 2))
    assert len(rows) == 1 and rows[0].allocated > 0
    print(measure.format_rows(rows))  # the ratio: the goal is within 10%, reported by gpu-verify
