"""The prefetch benchmark on a shrunk workload: every contender runs, the table is complete."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from lightning_accel.bench import BENCHMARKS
from lightning_accel.benchmarks.prefetch import main


def test_shrunk_benchmark_prints_every_contender(capsys, tmp_path):
    csv, svg = tmp_path / "trials.csv", tmp_path / "trials.svg"
    argv = ["--steps", "24", "--latency", "0.03", "--step", "0.005", "--shape", "4,100,3", "--hand-workers", "4"]
    assert main([*argv, "--csv", str(csv), "--plot", str(svg)]) == 0
    out = capsys.readouterr().out
    for name in (
        "plain loop",
        "DataLoader defaults",
        "Lightning's suggestion",
        "hand-tuned (workers=4)",
        "PrefetchTuner, from defaults",
        "PrefetchTuner, from cache (second run)",
        "Ray Data",
    ):
        assert name in out
    assert "PrefetchTuner: " in out and "targets, tuner from defaults: steady wait" in out
    assert out.rstrip().splitlines()[-3].startswith("machine: ")
    trials = csv.read_text().splitlines()
    assert trials[0].startswith("num_workers,prefetch_factor") and len(trials) >= 2
    # The plot: well-formed XML, one mark per setting tried, in the order of the CSV.
    circles = ET.parse(svg).getroot().findall(".//{http://www.w3.org/2000/svg}circle")
    assert len(circles) == len(trials) - 1
    assert [c.get("data-settings").split()[0] for c in circles] == [f"workers={t.split(',')[0]}" for t in trials[1:]]
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    plain = float(rows["plain loop"].split()[2])
    # Plain loop waits the latency on every step (0.03 s); generous bounds for a shared machine.
    assert 0.02 < plain < 0.2


def test_registered_under_prefetch():
    assert BENCHMARKS["prefetch"][1] is main


def test_too_few_steps_is_rejected():
    with pytest.raises(SystemExit, match=r"--steps 2 is too few"):
        main(["--steps", "2"])
    with pytest.raises(SystemExit, match=r"--steady-steps 0 must be at least 1"):
        main(["--steady-steps", "0"])


@pytest.mark.slow
def test_ray_data_contender_serves_every_item_once():
    ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'lightning-accel[ray]')")
    import torch

    from lightning_accel.benchmarks.prefetch import _RayData
    from lightning_accel.data.synthetic import SyntheticArrays

    dataset = SyntheticArrays(6, shape=(2, 5, 3), latency_s=0.0)
    try:
        batches = list(_RayData(dataset))
    finally:
        ray.shutdown()
    assert len(batches) == len(dataset)
    assert all(x.shape == (1, 2, 5, 3) and y.shape == (1, 1) for x, y in batches)
    # Ray may reorder; each item arrives exactly once, with the values the dataset made.
    expected = sorted(float(dataset[i][0].sum()) for i in range(len(dataset)))
    assert sorted(float(x.sum()) for x, _ in batches) == pytest.approx(expected)
    assert all(isinstance(x, torch.Tensor) for x, _ in batches)
