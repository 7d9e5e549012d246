"""The Fabric row of ``bench offload``: its hand-written loop trains the same model on the same tokens, optimizer and
loss as the Trainer rows (weights equal plain Lightning's after 3 steps), so its ratio to the Trainer's row is the
adapter's cost alone."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_accel.benchmarks.offload_fabric import fabric_measure
from lightning_accel.benchmarks.offload_workload import token_data
from lightning_accel.fabric import L2LOffloadStrategy
from lightning_accel.models import GPT, LanguageModelTask

_NET = {"preset": "tiny", "n_layer": 2}
_RUN = {"accelerator": "cpu", "batch": 2, "seq": 8, "steps": 3, "warmup": 1}


def test_the_fabric_row_trains_what_the_trainer_rows_train() -> None:
    row = fabric_measure(_NET, L2LOffloadStrategy(), **_RUN)
    assert row["step_s"] > 0 and row["stats"].steps == _RUN["steps"]
    torch.manual_seed(0)
    plain = LanguageModelTask(GPT(**_NET, block_size=_RUN["seq"]))
    pl.Trainer(accelerator="cpu", devices=1, max_steps=_RUN["steps"], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(plain, token_data(_RUN["batch"], _RUN["seq"], _RUN["steps"]))
    start = GPT(**_NET, block_size=_RUN["seq"]).state_dict()  # another seed's weights: the comparison is not vacuous
    assert any(not torch.allclose(start[k], v) for k, v in plain.net.state_dict().items())
    trained = row["task"].net.state_dict()
    for name, weight in plain.net.state_dict().items():
        got = trained[name]
        if name.endswith("attn.c_attn.bias"):  # the key bias has no gradient in exact arithmetic: AdamW scales rounding
            width = weight.numel() // 3        # noise there to lr-sized steps, so two correct runs differ by ~lr
            got, weight = torch.cat([got[:width], got[2 * width:]]), torch.cat([weight[:width], weight[2 * width:]])
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
