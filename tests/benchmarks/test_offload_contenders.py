"""The offload contenders of ``bench offload``: per-block FSDP2 CPU offload trains as plain Lightning does (weights
equal after 3 steps in fp32) with every block its own FSDP unit; ZeRO-3 offload says why it cannot run here."""

from __future__ import annotations

import importlib.util
import math

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from lightning_accel.benchmarks import offload_contenders
from lightning_accel.benchmarks.offload import _data
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
               enable_progress_bar=False, enable_model_summary=False).fit(task, _data(_RUN["batch"], _RUN["seq"], _RUN["steps"]))
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
