"""GracefulInterrupt in-process: SLURM's requeue signal saves the step and requeues the job as Lightning's
``SLURMEnvironment(auto_requeue=True)`` does (a stand-in ``scontrol`` records its arguments), and a step that outlives
the grace period ends the process with the signal's status, ``on_timeout`` told first. The exit statuses and the resume
of real runs are tests/test_resume.py's."""

from __future__ import annotations

import os
import signal
import stat
import threading
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader

from lightning_accel.callbacks import graceful_interrupt
from lightning_accel.callbacks.graceful_interrupt import GracefulInterrupt, RunInterrupted, exit_status


def test_the_requeue_signal_saves_the_step_and_requeues_the_slurm_job(sleepy, recorder, make_trainer, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "scontrol.calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)

    class SignalsAtStep2(recorder):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # what SLURM sends --signal=USR1@90 before the time limit
            return super().training_step(batch, batch_idx)

    interrupt = GracefulInterrupt(tmp_path / "checkpoints")
    trainer = make_trainer([interrupt], plugins=[SLURMEnvironment(auto_requeue=True)], max_steps=6)
    previous = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RunInterrupted) as raised:
        trainer.fit(SignalsAtStep2(), DataLoader(sleepy(16), batch_size=2))
    stop = raised.value
    assert (stop.signum, stop.step, stop.requeued, stop.exit_status) == (signal.SIGUSR1, 2, True, 128 + signal.SIGUSR1)
    assert calls.read_text().split() == ["requeue", "4242"]
    saved = torch.load(stop.checkpoint, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2 and Path(stop.checkpoint) == tmp_path / "checkpoints" / "last.ckpt"
    assert signal.getsignal(signal.SIGUSR1) == previous  # put back when the fit ended


def test_a_step_that_outlives_the_grace_period_ends_the_process_unsaved(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    ended = threading.Event()

    def fake_exit(code: int) -> None:  # os._exit would end the test process
        exits.append(code)
        ended.set()

    monkeypatch.setattr(graceful_interrupt.os, "_exit", fake_exit)
    told: list[int] = []
    interrupt = GracefulInterrupt(".", grace_s=0.2, on_timeout=told.append)
    interrupt._handle(signal.SIGTERM, None)
    interrupt._handle(signal.SIGTERM, None)  # a forwarded second SIGTERM changes nothing
    assert ended.wait(10)
    assert told == [signal.SIGTERM] and exits == [exit_status(signal.SIGTERM)] == [143]


@pytest.mark.parametrize("grace_s", [0, -1.0, float("nan")])
def test_a_grace_period_that_is_not_positive_is_refused(grace_s: float) -> None:
    with pytest.raises(ValueError, match=r"^grace_s=.*: the grace period must be a positive number of seconds; e.g. grace_s=120$"):
        GracefulInterrupt(".", grace_s=grace_s)
