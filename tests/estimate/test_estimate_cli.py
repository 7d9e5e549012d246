"""``lightning-accel estimate``: the JSON scripts read, and bad sizes refused in one line."""

from __future__ import annotations

import json

import pytest

from lightning_accel.cli import main


def test_json_ranks_add_up_and_judge_the_given_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "gpt-tiny_l2l_cpu", "data.batch_size=4", "--json", "--host-memory", "1MB"]) == 0
    out = json.loads(capsys.readouterr().out)
    (rank,) = out["ranks"]
    assert rank["kind"] == "device" and rank["count"] == 1
    assert rank["device_peak_bytes"] == sum(rank["components"]["device"].values()) == 0  # the CPU is the device
    assert rank["host_bytes"] == sum(rank["components"]["host"].values()) == out["host_total_bytes"]
    assert out["host_memory_bytes"] == 10**6 and out["host_total_bytes"] > 10**6 and out["fits"] is False


def test_table_ends_with_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "llama-tiny_cpu", "data.batch_size=4", "--host-memory", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state" in out and "activations" in out
    verdict, note = out.splitlines()[-2:]
    assert "fits: device: the CPU" in verdict and note.startswith("note: these are tensor bytes") and "MALLOC_MMAP_THRESHOLD_" in note


def test_a_size_without_a_unit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "llama-tiny_cpu", "--device-memory", "lots"]) == 2
    assert "write e.g. 24GB" in capsys.readouterr().err
