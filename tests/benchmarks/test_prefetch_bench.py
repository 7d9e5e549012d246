"""The prefetch benchmark on a shrunk workload: every contender runs, the table is complete."""

from __future__ import annotations

import itertools
import xml.etree.ElementTree as ET

import pytest

from lightning_accel.bench import BENCHMARKS
from lightning_accel.benchmarks.prefetch import main


def test_shrunk_benchmark_prints_every_contender(capsys, tmp_path):
    csv, svg = tmp_path / "trials.csv", tmp_path / "trials.svg"
    argv = ["--workloads", "seed004", "--sweep", "2", "--steps", "24", "--latency", "0.03", "--step", "0.005"]
    argv += ["--shape", "4,100,3", "--hand-workers", "4", "--repeat", "1"]
    assert main([*argv, "--csv", str(csv), "--plot", str(svg)]) == 0
    out = capsys.readouterr().out
    for name in (
        "plain loop",
        "DataLoader defaults",
        "Lightning's suggestion",
        "hand-set workers=2",
        "hand-set workers=4",
        "<- best hand-set",
        "PrefetchTuner, from defaults",
        "PrefetchTuner, from cache (second run)",
        "Ray Data",
    ):
        assert name in out
    assert "targets, tuner from defaults: steady wait" in out and "seed004: tuner fit" in out
    assert out.rstrip().splitlines()[-1].startswith("machine: ") and "load average" in out
    trials = csv.read_text().splitlines()
    assert trials[0].startswith("num_workers,prefetch_factor") and len(trials) >= 2
    # The plot: well-formed XML, one mark per setting tried, in the order of the CSV.
    circles = ET.parse(svg).getroot().findall(".//{http://www.w3.org/2000/svg}circle")
    assert len(circles) == len(trials) - 1
    assert [c.get("data-settings").split()[0] for c in circles] == [f"workers={t.split(',')[0]}" for t in trials[1:]]
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    plain = float(rows["plain loop"].split()[2])
    # Every ratio is against the fastest hand-set row, which reads 1.00x.
    best = next(line for line in out.splitlines() if "<- best hand-set" in line)
    assert best.startswith("hand-set workers=") and "1.00x" in best
    # Plain loop waits the latency on every step (0.03 s); generous bounds for a shared machine.
    assert 0.02 < plain < 0.2


def test_registered_under_prefetch():
    assert BENCHMARKS["prefetch"][1] is main


def test_stream_and_jpeg_workloads_shrunk(capsys):
    pytest.importorskip("PIL", reason="the JPEG workloads need Pillow (pip install 'lightning-accel[bench]')")
    argv = ["--workloads", "stream,jpeg,jpeg-tar", "--sweep", "2", "--stream-steps", "16", "--stream-latency", "0.02"]
    argv += ["--stream-step", "0.005", "--jpeg-steps", "6", "--images", "32", "--jpeg-batch", "4", "--jpeg-size", "32"]
    assert main([*argv, "--jpeg-step", "0.001", "--steady-steps", "4", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for header in ("== stream: endless IterableDataset", "== jpeg: 320x240 JPEGs decoded with Pillow", "== jpeg-tar:"):
        assert header in out
    assert out.count("<- best hand-set") == 3 and out.count("PrefetchTuner, from defaults") == 3
    assert "targets: tuner steady wait over the last" in out and "jpeg-tar: tuner fit" in out
    # Two rounds: medians with their range, each round's tuner said, and the paired ratio per round.
    assert out.count("fit s (median of 2)") == 3 and out.count("tuner round 2: ") == 3
    tuner_rows = [line for line in out.splitlines() if line.startswith("PrefetchTuner, from defaults")]
    for line in tuner_rows:
        low, high = (float(x) for x in line.split()[6].split("-"))  # fit range s
        assert low <= float(line.split()[5]) <= high  # the median lies in it
    assert out.count("; per round ") == 3


def test_too_few_steps_is_rejected():
    with pytest.raises(SystemExit, match=r"--steps 2 is too few"):
        main(["--steps", "2"])
    with pytest.raises(SystemExit, match=r"--stream-steps 3 is too few"):
        main(["--stream-steps", "3"])
    with pytest.raises(SystemExit, match=r"--steady-steps 0 must be at least 1"):
        main(["--steady-steps", "0"])
    with pytest.raises(SystemExit, match=r"--repeat 0 must be at least 1"):
        main(["--repeat", "0"])
    with pytest.raises(SystemExit):
        main(["--workloads", "seed004,video"])  # argparse: unknown workload, one line and exit 2
    with pytest.raises(SystemExit, match=r"--images 8 is fewer than one batch"):
        main(["--images", "8"])


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


def test_jpeg_tar_stream_reads_every_sample_once_per_pass_with_workers(tmp_path):
    pytest.importorskip("PIL", reason="the JPEG workloads need Pillow (pip install 'lightning-accel[bench]')")
    import torch
    from torch.utils.data import DataLoader

    from lightning_accel.benchmarks.decode_data import JpegFiles, JpegTarStream, write_jpegs, write_shards

    paths = write_jpegs(tmp_path / "img", 12, size=(48, 32))
    stream = JpegTarStream(write_shards(paths, tmp_path / "tar", 4), out=16)
    files = JpegFiles(paths, out=16)
    assert stream.chunk == 4 and len(stream.index) == 12
    served = list(itertools.islice(iter(DataLoader(stream, batch_size=None, num_workers=3)), 12))
    # Position p of the stream is file p with the same crop: each sample once over 3 workers reading whole shards.
    assert sorted(round(float(x.sum()), 2) for x, _ in served) == sorted(round(float(files[i][0].sum()), 2) for i in range(12))
    assert sorted(int(y) for _, y in served) == sorted(int(files[i][1]) for i in range(12))
    x, _ = files[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and abs(float(x.mean())) < 3
