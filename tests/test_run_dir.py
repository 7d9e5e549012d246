"""run.json stays true after a crash: dead runs become ``killed``, their half-written
checkpoints go, ``last.ckpt`` is the newest; ``ckpt_path=last`` takes only a fitting run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_accel.config.errors import UserError
from lightning_accel.run_dir import find_last_checkpoint, is_alive, reap, this_process


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(root: Path, name: str, status: dict, net: dict | None = None, ckpts: tuple[str, ...] = ()) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(status))
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"model": {"net": net or {"n_layer": 4}}}), run / ".hydra" / "config.yaml")
    for i, ckpt in enumerate(ckpts):
        path = run / "checkpoints" / ckpt
        path.write_text(ckpt)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + i * 1_000_000_000))  # in the order given
    return run


def test_a_dead_running_run_is_marked_killed_and_its_checkpoints_made_true(tmp_path: Path) -> None:
    me = this_process()
    dead = _run(tmp_path, "a", {"status": "running", **me, "pid": _dead_pid(), "pid_start": None},
                ckpts=("last.ckpt", "step000004.ckpt"))
    (dead / "checkpoints" / ".last.ckpt.x1y2.tmp").write_text("half")
    alive = _run(tmp_path, "b", {"status": "running", **me}, ckpts=("last.ckpt",))
    done = _run(tmp_path, "c", {"status": "completed", **me, "pid": _dead_pid()})

    assert reap(tmp_path) == [dead]
    status = json.loads((dead / "run.json").read_text())
    assert status["status"] == "killed" and "killed" in status["error"]
    assert not list(dead.glob("checkpoints/.*.tmp"))
    # the kill came between step000004.ckpt and last.ckpt: last.ckpt is now that step
    assert (dead / "checkpoints" / "last.ckpt").read_text() == "step000004.ckpt"
    assert json.loads((alive / "run.json").read_text())["status"] == "running"
    assert json.loads((done / "run.json").read_text())["status"] == "completed"


def test_liveness_of_this_process_a_dead_one_and_another_host() -> None:
    assert is_alive(this_process())
    assert not is_alive({**this_process(), "pid": _dead_pid(), "pid_start": None})
    assert is_alive({"pid": _dead_pid(), "host": "some-other-host"})  # cannot tell: never marked


def test_ckpt_last_takes_the_newest_fitting_run_and_names_a_misfit(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"model": {"net": {"n_layer": 4}}})
    old = _run(tmp_path, "old", {"status": "completed"}, {"n_layer": 4}, ("last.ckpt",))
    time.sleep(0.01)
    _run(tmp_path, "new", {"status": "completed"}, {"n_layer": 2}, ("last.ckpt",))
    assert find_last_checkpoint(tmp_path, cfg) == old / "checkpoints" / "last.ckpt"
    with pytest.raises(UserError, match=r"ckpt_path=last found .*/new but its network differs: model.net.n_layer=2 in that run, 6 now"):
        find_last_checkpoint(tmp_path, OmegaConf.create({"model": {"net": {"n_layer": 6}}}))
    with pytest.raises(UserError, match="no earlier run of this recipe"):
        find_last_checkpoint(tmp_path / "none", cfg)


def test_runs_claiming_one_directory_at_once_each_get_their_own(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lightning_accel.run_dir import claim_run_dir

    where = tmp_path / "outputs" / "gpt-tiny_cpu" / "2026-12-02_13-00-00"  # named by the second: every run at once names it
    with ThreadPoolExecutor(8) as pool:
        claimed = list(pool.map(lambda _: claim_run_dir(where), range(16)))
    assert len(set(claimed)) == 16 and all(p.is_dir() and not any(p.iterdir()) for p in claimed)
    assert sorted(p.name for p in claimed) == sorted([where.name, *(f"{where.name}_{n}" for n in range(1, 16))])


def test_a_requeued_slurm_job_finds_the_run_it_interrupted(tmp_path: Path) -> None:
    from lightning_accel.run_dir import requeued_checkpoint

    _run(tmp_path, "a", {"status": "interrupted", "slurm_job": "77_3"}, ckpts=("last.ckpt",))
    _run(tmp_path, "b", {"status": "interrupted", "slurm_job": "78"}, ckpts=("last.ckpt",))
    assert requeued_checkpoint(tmp_path, "77_3") == tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert requeued_checkpoint(tmp_path, "99") is None


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_directory_never_share_it(tmp_path: Path, cli_env: dict, cli_processes) -> None:
    same = tmp_path / "outputs" / "same"
    args = ["run", "gpt-tiny_cpu", "trainer.max_steps=2", "trainer.limit_val_batches=1", "data.block_size=32", "data.batch_size=4",
            f"hydra.run.dir={same}"]
    done = cli_processes.side_by_side({"a": cli_processes.job(args, cli_env), "b": cli_processes.job(args, cli_env)})
    assert [p.returncode for p in done.values()] == [0, 0], [p.stderr[-2000:] for p in done.values()]
    runs = sorted(p.parent for p in same.parent.glob("*/run.json"))
    assert [p.name for p in runs] == ["same", "same_1"]
    pids = set()
    for run in runs:
        status = json.loads((run / "run.json").read_text())
        assert status["status"] == "completed" and status["output_dir"] == str(run), status
        assert (run / "checkpoints" / "last.ckpt").is_file()  # each run's own, never last-v1.ckpt beside another's
        assert not list((run / "checkpoints").glob("last-v*.ckpt"))
        pids.add(status["pid"])
    assert len(pids) == 2
