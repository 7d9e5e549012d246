"""Every value a run reads, checked before any work: one line naming the key, the value and the fix, exit status 2.

Fresh examples of each kind of value (issue 51's escapes were others of the same kinds): the Trainer's loop and the
seed, the optimizer's and scheduler's arguments (by type, and torch's own checks when built and at the first step),
a strategy's options against the model, the model against the data's shapes, interpolations, the run directory, every
job of a multirun. Each case edits a copy of a recipe composed once (tests/support/edited_configs.py) and asks
:func:`~lightning_accel.config.preflight.check_job`, what ``run`` and ``validate`` ask of every
job; one case of each end-to-end kind goes through ``lightning-accel run``, where no run directory may be made.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_accel import cli
from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import check_job, check_run_dir
from tests.support.edited_configs import composed, job

ONE_CYCLE_OFF = ["~model.scheduler.max_lr", "~model.scheduler.total_steps", "~model.scheduler.pct_start", "~model.scheduler.cycle_momentum"]


def _scheduler(target: str, *args: str) -> list[str]:
    return [f"model.scheduler._target_=torch.optim.lr_scheduler.{target}", *ONE_CYCLE_OFF, *args]

# (kind, recipe, overrides, the line's pattern)
CASES: list[tuple[str, str, list[str], str]] = [
    # a key added at the top level, which nothing reads
    ("top-level", "gpt-tiny_cpu", ["+seeds=3"], r"^unknown top-level key 'seeds' \(added with \+seeds=...\) \(did you mean 'seed'\?\): "
                                                  r"nothing reads it; check the spelling"),
    # the Trainer's loop: what Lightning takes unchecked, and what it refuses in words without our key
    ("loop", "gpt-tiny_cpu", ["trainer.limit_train_batches=0.0"], r"^trainer.limit_train_batches=0.0 trains no step.*; pass a number of batches >= 1"),
    ("loop", "gpt-tiny_cpu", ["trainer.max_epochs=0", "trainer.max_steps=-1"], r"^trainer.max_epochs=0 trains no step"),
    ("loop", "gpt-tiny_cpu", ["trainer.max_steps=10", "trainer.min_epochs=3", "trainer.max_epochs=2"],
     r"^trainer.min_epochs=3 exceeds trainer.max_epochs=2: .*; raise trainer.max_epochs to at least 3, or lower trainer.min_epochs"),
    ("loop", "gpt-tiny_cpu", ["trainer.log_every_n_steps=0"], r"^trainer.log_every_n_steps=0 is not allowed; pass a number of steps >= 1"),
    ("loop", "gpt-tiny_cpu", ["trainer.val_check_interval=1.5"], r"^trainer.val_check_interval=1.5 is not allowed; .*a fraction of the epoch in \(0, 1\]"),
    ("loop", "gpt-tiny_cpu", ["trainer.check_val_every_n_epoch=0"], r"^trainer.check_val_every_n_epoch=0 is not allowed"),
    ("loop", "gpt-tiny_cpu", ["trainer.gradient_clip_val=-0.5"], r"^trainer.gradient_clip_val=-0.5 is not allowed; pass a gradient norm"),
    ("loop", "gpt-tiny_cpu", ["trainer.num_sanity_val_steps=-4"], r"^trainer.num_sanity_val_steps=-4 is not allowed; .*or -1"),
    ("loop", "gpt-tiny_cpu", ["trainer.deterministic=sometimes"], r"^trainer.deterministic='sometimes' is not allowed; pass true, false, warn or null"),
    ("loop", "gpt-tiny_cpu", ["trainer.devices=0"], r"^trainer.devices=0 is not allowed; pass a number of devices >= 1"),
    ("loop", "gpt-tiny_cpu", ["trainer.max_time=90m"], r"^trainer.max_time='90m' is not allowed \(write trainer.max_time=00:01:30:00\)"),
    ("loop", "gpt-tiny_cpu", ["trainer.limit_val_batches=2.5"], r"^trainer.limit_val_batches=2.5 is not allowed"),
    ("loop", "gpt-tiny_cpu", ["trainer.overfit_batches=-2"], r"^trainer.overfit_batches=-2 is not allowed; pass a number of batches >= 0"),
    ("loop", "gpt-tiny_cpu", ["trainer.val_check_interval=0.5"],  # Lightning's own check, reworded with our key and a fix
     r"^trainer.val_check_interval=0.5: `val_check_interval` should be an integer .* when `check_val_every_n_epoch=None`; pass"),
    ("seed", "gpt-tiny_cpu", ["seed=4294967296"], r"^seed=4294967296 is outside \[0, 4294967295\] .*; pass e.g. seed=1234"),
    ("seed", "gpt-tiny_cpu", ["seed=twelve"], r"^seed='twelve' is not a whole number; pass an integer"),
    # the optimizer and the scheduler: the argument's type, finiteness, and torch's own checks
    ("optimizer", "gpt-tiny_cpu", ["model.optimizer.lr=inf"], r"^model.optimizer.lr=inf is not a finite number \(AdamW's lr\); pass a finite value, e\.g\. model.optimizer.lr=0.001"),
    ("optimizer", "gpt-tiny_cpu", ["model.optimizer.betas=[0.9]"], r"^model.optimizer.betas=\[0.9\]: AdamW's betas takes a list of 2 numbers; pass e.g. model.optimizer.betas=\[0.9, 0.999\]"),
    ("optimizer", "gpt-tiny_cpu", ["model.optimizer.weight_decay=-0.1"], r"^model.optimizer.weight_decay=-0.1: AdamW refuses it \(Invalid weight_decay value: -0.1, when built\)"),
    ("optimizer", "resnet-tiny_cpu", ["model.optimizer._target_=torch.optim.SGD", "+model.optimizer.momentum=-0.5"],
     r"^model.optimizer.momentum=-0.5: SGD refuses it \(Invalid momentum value: -0.5, when built\); pass a value SGD takes"),
    ("optimizer", "gpt-tiny_cpu", ["+model.optimizer.amsgrad=maybe"], r"^model.optimizer.amsgrad='maybe': AdamW's amsgrad takes true or false"),
    ("scheduler", "gpt-tiny_cpu", _scheduler("StepLR", "+model.scheduler.step_size=0"),
     r"^model.scheduler.step_size=0: StepLR refuses it \(ZeroDivisionError: integer modulo by zero, at its first step\); .*> 0"),
    ("scheduler", "gpt-tiny_cpu", _scheduler("ExponentialLR", "+model.scheduler.gamma=fast"), r"^model.scheduler.gamma='fast': ExponentialLR's gamma takes a number"),
    ("scheduler", "gpt-tiny_cpu", ["model.scheduler.pct_start=1.5"], r"^model.scheduler.pct_start=1.5: OneCycleLR refuses it \(Expected float between 0 and 1"),
    ("scheduler", "gpt-tiny_cpu", ["+model.scheduler.anneal_strategy=quadratic"], r"^model.scheduler.anneal_strategy='quadratic': OneCycleLR's anneal_strategy takes one of cos, linear"),
    ("scheduler", "gpt-tiny_cpu", ["model.scheduler.max_lr=fast"], r"^model.scheduler.max_lr='fast': OneCycleLR's max_lr takes a number"),
    ("scheduler", "gpt-tiny_cpu", ["trainer.max_steps=10"],  # a warm-up of pct_start x total_steps = 1 step: torch divides by 0
     r"^model.scheduler \(OneCycleLR: .*total_steps=10 \(from trainer.max_steps\), pct_start=0.1.*\): ZeroDivisionError: float division "
     r"by zero \(when built\); change one of these model.scheduler values"),
    ("scheduler", "gpt-tiny_cpu", ["model.scheduler.max_lr=-0.5"],  # torch checks lr when the optimizer is built, not the lr a schedule sets
     r"^model.scheduler.max_lr=-0.5: OneCycleLR sets AdamW's param group to what AdamW refuses \(Invalid learning rate: -0.02, at its "
     r"first step|^model.scheduler.max_lr=-0.5: OneCycleLR sets AdamW's param group .*; pass a positive model.scheduler.max_lr"),
    ("loop", "gpt-tiny_cpu", ["trainer.fast_dev_run=-3"], r"^trainer.fast_dev_run=-3 is not allowed; pass true, false or a number of batches >= 0"),
    # a constructor's own refusal, keyed by the setting it names (model.net.dropout, not "model")
    ("constructor", "gpt-tiny_cpu", ["model.net.dropout=2.0"], r"^model.net.dropout=2.0: dropout must be in \[0, 1\), got 2.0; set model.net.dropout"),
    ("constructor", "resnet-tiny_cpu", ["data.image_size=6"], r"^data.image_size=6: image_size=6 is below 8 pixels"),
    ("constructor", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.delayed_update_warmup=3"],
     r"^strategy.delayed_update_warmup=3: delayed_update_warmup=3 has no effect with delayed_update=False; set delayed_update=True"),
    # a strategy's options against the model (GPT tiny: 4 blocks)
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.prefetch_blocks=4"],
     r"^strategy.prefetch_blocks=4: the model has 4 blocks \(GPTBlock\), so at most 3 can be copied ahead"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload_ddp", "trainer.devices=2", "strategy.prefetch_blocks=9"], r"^strategy.prefetch_blocks=9: the model has 4 blocks"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload_ddp", "trainer.devices=2", "strategy.delayed_update=true", "strategy.nvme_path=/tmp"],
     r"^strategy.nvme_path=/tmp: strategy.nvme_path with delayed_update=True is not supported: .*; set delayed_update=False or drop nvme_path"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload_ddp", "trainer.devices=2", "strategy.host_budget=lots"],
     r"^strategy.host_budget='lots' is not a size"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.prefetch_blocks=true"],
     r"^strategy.prefetch_blocks=True: L2LOffloadStrategy: prefetch_blocks takes an int >= 0 .*got the bool True"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.offload_resident=maybe"],
     r"^strategy.offload_resident='maybe': L2LOffloadStrategy: offload_resident takes True or False.*; pass strategy.offload_resident=True or"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.blocks=[torch.optim.AdamW]"],
     r"^strategy.blocks=\['torch.optim.AdamW'\]: block class 'torch.optim.AdamW' is a class but not an nn.Module|is a type, not an nn.Module"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "strategy.blocks=7"], r"^strategy.blocks=7: L2LOffloadStrategy: blocks takes 'auto'"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "trainer.num_nodes=2"], r"^trainer.devices=1 x num_nodes=2: strategy='l2l_offload' trains on one device"),
    ("strategy", "gpt-tiny_cpu", ["strategy=l2l_offload", "+strategy.device=cuda:0"],
     r"^strategy.device='cuda:0': L2LOffloadStrategy: device='cuda:0' computes on cuda, but the Trainer's accelerator is cpu"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe", "strategy.devices=[cpu,cpu,cpu,cpu,cpu]"],
     r"^strategy.devices=\['cpu', 'cpu', 'cpu', 'cpu', 'cpu'\]: 5 stages \(one per device\) for the model's 4 blocks would leave 1 device\(s\) idle"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe", "strategy.devices=[cpu,cpu,cpu]", "strategy.balance=[2,2]"],
     r"^strategy.balance=\[2, 2\]: GPipeStrategy: balance \[2, 2\] has 2 stages but devices=\['cpu', 'cpu', 'cpu'\] gives 3"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe_distributed", "trainer.devices=2", "strategy.balance=[3,3]"],
     r"^strategy.balance=\[3, 3\]: the balance does not cover the model's blocks \(blocks: 4, sum of balance \[3, 3\]: 6\)"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe_distributed", "trainer.devices=6"],
     r"^trainer.devices=6: 6 ranks per pipeline run 6 stages .*more than the model's 4 blocks"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe_distributed", "strategy.timeout=0"], r"^strategy.timeout=0: DistributedGPipeStrategy: timeout must be a finite number of seconds > 0"),
    ("strategy", "gpt-tiny_cpu", ["strategy=gpipe_distributed", "strategy.loss_reduction=avg"],
     r"^strategy.loss_reduction=avg: loss_reduction must be 'mean' or 'sum' .*; set strategy.loss_reduction to a value it allows"),
    # the model against the data's shapes
    ("data", "gpt-tiny_cpu", ["model.net.block_size=16"],
     r"^data.block_size=128: the data's windows of 128 tokens exceed the 16 positions GPT was built with \(model.net.block_size=16\)"),
    ("scheduler", "gpt-tiny_cpu", ["trainer.max_steps=-1", "trainer.max_epochs=2"],  # one-cycle's length is max_steps
     r"^model.scheduler.total_steps=-1 \(from trainer.max_steps\): OneCycleLR refuses it \(Expected positive integer total_steps, but got "
     r"-1, when built\); set trainer.max_steps, which it reads, to a value OneCycleLR takes"),
    ("data", "gpt-tiny_cpu", ["model.net.vocab_size=200"], r"^model.net.vocab_size=200: the model embeds 200 symbols but the data has 256 .*; set model.net.vocab_size=256"),
    ("data", "llama-tiny_cpu", ["model.net.config.vocab_size=128"], r"^model.net.config.vocab_size=128: the model embeds 128 symbols"),
    ("data", "resnet-tiny_cpu", ["model.net.in_channels=4"], r"^model.net.in_channels=4: the model's first convolution takes 4 channel\(s\) but the data's images have 3"),
    ("data", "resnet-tiny_cpu", ["model.net.num_classes=3"], r"^model.net.num_classes=3: the model scores 3 classes but the data has 6"),
    # values that are references, paths and directories
    ("interpolation", "gpt-tiny_cpu", ["trainer.val_check_interval=${trainer.max_stepz}"],
     r"^trainer.val_check_interval=\$\{trainer.max_stepz\}: the interpolation reads 'trainer.max_stepz', which does not exist \(did you mean 'trainer.max_steps'"),
    ("interpolation", "gpt-tiny_cpu", ["trainer.max_steps=${steps:8}"], r"^trainer.max_steps=\$\{steps:8\}: there is no resolver 'steps'"),
]


def _refusal(recipe: str, overrides: list[str]) -> str:
    cfg, path = job(recipe, overrides)
    with pytest.raises(UserError) as refused:
        check_job(cfg, path, launch=False)
    line = str(refused.value)
    assert "\n" not in line and "; " in line, line  # one line, the fix after the value and what is wrong
    return line


@pytest.mark.parametrize(("kind", "recipe", "overrides", "pattern"), CASES, ids=[f"{c[0]}: {' '.join(c[2])}" for c in CASES])
def test_a_bad_value_is_refused_before_work_in_one_line(kind: str, recipe: str, overrides: list[str], pattern: str) -> None:
    line = _refusal(recipe, overrides)
    assert re.search(pattern, line), line


# ``run`` asks the same check_job (test_cli.py runs its own table through run and validate alike): two of the checks new
# in issue 51, through run: refused in one line, exit status 2, no run directory made
END_TO_END = [("data", ["model.net.vocab_size=128"]), ("strategy", ["strategy=l2l_offload", "strategy.prefetch_blocks=6"])]


@pytest.mark.parametrize(("kind", "overrides"), END_TO_END, ids=[k for k, _ in END_TO_END])
def test_run_refuses_it_in_one_line_and_makes_no_run_directory(kind: str, overrides: list[str], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "gpt-tiny_cpu", *overrides]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning-accel")]
    assert len(lines) == 1 and lines[0].startswith(f"lightning-accel: error: {overrides[-1].split('=')[0]}="), lines
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("overrides", [
    ["model.net.block_size=32", "data.block_size=32"],  # positions = windows: fits
    ["trainer.max_epochs=2", "trainer.max_steps=20", "trainer.min_epochs=2", "trainer.min_steps=20"],
    ["trainer.limit_train_batches=0.5", "trainer.val_check_interval=1", "trainer.max_time=00:01:30:00", "seed=0", "trainer.devices=-1"],
    ["strategy=l2l_offload", "strategy.prefetch_blocks=3"],
    ["strategy=l2l_offload_ddp", "trainer.devices=2", "strategy.nvme_path=/tmp", "strategy.host_budget=8GB"],
], ids=" ".join)
def test_values_at_their_limits_pass(overrides: list[str]) -> None:
    """The checks refuse what is wrong only (a check that refused every value would pass the cases above)."""
    check_job(*job("gpt-tiny_cpu", overrides), launch=False)


def test_every_job_of_a_multirun_is_checked_before_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second value only a constructor refuses (not composition) ends the sweep before job 1 trains, naming the job."""
    from lightning_accel.sweep import sweep_jobs

    assert cli.main(["run", "gpt-tiny_cpu", "-m", "trainer.max_steps=8", "trainer.min_steps=1,50"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"lightning-accel: error: multirun job 2 of 2 \(trainer.min_steps=50\): trainer.min_steps=50 exceeds "
                        r"trainer.max_steps=8: .*; raise trainer.max_steps to at least 50, or lower trainer.min_steps", line), line
    assert not (tmp_path / "outputs").exists()
    cfg = composed("gpt-tiny_cpu")
    assert sweep_jobs(cfg, ["trainer.max_steps=4"]) is None  # a single run
    assert sweep_jobs(cfg, ["model.optimizer.lr=1e-3,nan", "seed=1,2"]) == [  # a basic sweep: its jobs, in Hydra's order
        ["model.optimizer.lr=0.001", "seed=1"], ["model.optimizer.lr=0.001", "seed=2"], ["model.optimizer.lr=nan", "seed=1"],
        ["model.optimizer.lr=nan", "seed=2"]]
    assert sweep_jobs(cfg, ["seed=range(0,30)", "data.batch_size=2,4"])[:3] == [  # 60 jobs: each value once
        ["seed=0", "data.batch_size=2"], ["seed=1", "data.batch_size=2"], ["seed=2", "data.batch_size=2"]]
    assert len(sweep_jobs(cfg, ["seed=range(0,30)", "data.batch_size=2,4"])) == 31


def test_a_run_directory_that_cannot_be_made_is_refused_before_hydra_tries(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for key, where, multirun, pattern in [
        ("hydra.run.dir", a_file, False, rf"hydra.run.dir='{a_file}' is a file, not a directory; point hydra.run.dir at a directory"),
        ("hydra.run.dir", a_file / "run", False, rf"hydra.run.dir='{a_file}/run' cannot be made: '{a_file}' is a file"),
        ("hydra.sweep.dir", a_file, True, rf"hydra.sweep.dir='{a_file}' is a file, not a directory"),
    ]:
        cfg = OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "fine")}, "sweep": {"dir": str(tmp_path / "fine")}}})
        OmegaConf.update(cfg, key, str(where))
        with pytest.raises(UserError, match=pattern):
            check_run_dir(cfg, multirun)
        check_run_dir(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "new" / "run")}}}), multirun=False)
