"""The offload contenders of ``bench offload``: per-block FSDP2 CPU offload trains as plain Lightning does (weights
equal after 3 steps in fp32) with every block its own FSDP unit; ZeRO-3 offload says why it cannot run here; the
``--contenders`` CPU table and the CUDA table's columns."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from lightning_accel.benchmarks import offload, offload_contenders
from lightning_accel.benchmarks.offload_workload import token_data
from lightning_accel.benchmarks.offload_contenders import fsdp2_offload, zero3_offload
from lightning_accel.models import GPT, LanguageModelTask

_NET = {"preset": "tiny", "n_layer": 3}
_RUN = {"accelerator": "cpu", "batch": 2, "seq": 16, "steps": 3, "warmup": 1}


@pytest.fixture(scope="module")
def fsdp2_row() -> dict:
    return fsdp2_offload(_NET, "32-true", **_RUN)


def _plain_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    task = LanguageModelTask(GPT(**_NET, block_size=_RUN["seq"]))
    pl.Trainer(accelerator="cpu", devices=1, max_steps=_RUN["steps"], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(task, token_data(_RUN["batch"], _RUN["seq"], _RUN["steps"]))
    return {k: v.detach().clone() for k, v in task.net.state_dict().items()}


def test_fsdp2_offload_trains_as_plain_lightning(fsdp2_row: dict) -> None:
    assert not fsdp2_row["oom"] and fsdp2_row["tokens_per_s"] > 0 and fsdp2_row["host_gib"] >= 0
    assert fsdp2_row["params"] == sum(p.numel() for p in GPT(**_NET, block_size=_RUN["seq"]).parameters())
    trained = {k: v.full_tensor() for k, v in fsdp2_row["task"].net.state_dict().items()}
    plain = _plain_weights()
    assert trained.keys() == plain.keys()
    start = GPT(**_NET, block_size=_RUN["seq"])  # a different seed's weights: the comparison below is not vacuous
    assert any(not torch.allclose(plain[k], v) for k, v in start.state_dict().items())
    for name, weight in plain.items():
        torch.testing.assert_close(trained[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fsdp2_offload_shards_each_block_as_its_own_unit(fsdp2_row: dict) -> None:
    net = fsdp2_row["task"].net
    units = [m for m in net.modules() if isinstance(m, FSDPModule)]
    assert units == [net, *net.blocks]  # the root and one unit per block, not the whole model as one
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        assert isinstance(group.offload_policy, CPUOffloadPolicy) and not group.offload_policy.pin_memory
        owned = {id(p.sharded_param) for p in group.fsdp_params}
        # a block's unit holds exactly that block's parameters; the root's the embedding and head (tied: once)
        inside = list(unit.parameters()) if unit is not net else [*net.pre.parameters(), *net.post.parameters()]
        assert owned == {id(p) for p in inside}
    assert all(p.to_local().device.type == "cpu" for p in net.parameters())


def test_fsdp2_offload_refuses_a_precision_it_does_not_compare() -> None:
    with pytest.raises(ValueError, match="precision '16-mixed' is not one it compares; use '32-true' or 'bf16-mixed'"):
        fsdp2_offload(_NET, "16-mixed", **_RUN)


def test_zero3_offload_says_why_it_cannot_run_here(monkeypatch: pytest.MonkeyPatch) -> None:
    row = zero3_offload(_NET, "32-true", **_RUN)
    assert math.isnan(row["step_s"]) and not row["oom"]
    if importlib.util.find_spec("deepspeed") is None:
        assert row["skipped"] == "deepspeed not installed (pip install deepspeed, constrained to this torch)"
    spec = importlib.util.find_spec("json")  # any importable module: deepspeed "installed"
    monkeypatch.setattr(offload_contenders.importlib.util, "find_spec", lambda name: spec)
    assert zero3_offload(_NET, "32-true", **_RUN)["skipped"] == "needs CUDA (Lightning's DeepSpeedStrategy runs on CUDA GPUs only)"


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line.strip())


def test_bench_offload_contenders_cpu_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--only", "fit", "--contenders", "--layers", "2", "--seq", "16", "--batch", "2", "--steps", "3", "--warmup", "1",
            "--rounds", "1"]
    assert offload.main(argv) == 0
    out = capsys.readouterr().out
    assert "offload contenders: GPT tiny x2 layers" in out and "l2l_offload, delayed update" not in out
    assert _row(out, "plain Lightning")[2] == "1.00"
    assert float(_row(out, "l2l_offload (defaults)")[2]) > 0 and float(_row(out, "FSDP2 offload, per block")[2]) > 0
    if importlib.util.find_spec("deepspeed") is None:
        assert _row(out, "ZeRO-3 offload")[1:] == ["not run", "-"]
        assert "ZeRO-3 offload: not run, deepspeed not installed (pip install deepspeed, constrained to this torch)" in out


def test_bench_offload_cuda_table_sets_l2l_against_the_faster_contender(monkeypatch: pytest.MonkeyPatch) -> None:
    # the CUDA table's arithmetic on given rows (no GPU here): l2l 300 tok/s against plain 400, FSDP2 100 and ZeRO-3 200
    def measure(net: dict, strategy: object, *args: object, **kwargs: object) -> dict:
        if isinstance(strategy, offload.L2LOffloadStrategy):
            return {"oom": False, "tokens_per_s": 300.0, "peak_gib": 2.0, "params": 1.5e9}
        return {"oom": net["n_layer"] == 48, "tokens_per_s": 400.0, "peak_gib": 70.0}

    def fsdp2(*args: object, **kwargs: object) -> dict:
        return {"oom": False, "tokens_per_s": 100.0, "peak_gib": 3.0}

    def zero3(net: dict, *args: object, **kwargs: object) -> dict:
        if net["n_layer"] == 48:
            return {"oom": False, "step_s": float("nan"), "skipped": "needs CUDA"}
        return {"oom": False, "tokens_per_s": 200.0, "peak_gib": 4.0}

    monkeypatch.setattr(offload, "_measure", measure)
    monkeypatch.setattr(offload, "pinned_bandwidth_gbs", lambda: 25.0)
    monkeypatch.setattr(offload_contenders, "CONTENDERS", {"FSDP2 offload, per block": fsdp2, "ZeRO-3 offload": zero3})
    out = offload._cuda_table(argparse.Namespace(gpu_layers=[12, 48], batch=1, seq=8, steps=3, warmup=1))
    assert _row(out, "12") == ["12", "1.50B", "400", "100", "200", "300", "0.75", "1.50", "70.0", "3.0", "4.0", "2.0", "nan"]
    assert _row(out, "48") == ["48", "1.50B", "OOM", "100", "n/a", "300", "-", "3.00", "-", "3.0", "-", "2.0", "nan"]
    assert out.rstrip().endswith("ZeRO-3 offload: n/a, needs CUDA") and "fsdp_cpu_offload" not in out
