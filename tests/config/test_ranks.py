"""A re-launched rank runs preflight on its own composition and is refused by name when it differs from rank 0's.

In process: a rank's environment is simulated (``LIGHTNING_ACCEL_RECIPE``, ``LOCAL_RANK`` and rank 0's published
fingerprint), so the rank's path through ``lightning-accel`` runs without starting a process or a process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel import cli
from lightning_accel.config.compose import resolve_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import preflight
from lightning_accel.config.ranks import CONFIG_ENV, check_rank, fingerprint, publish

# what Lightning adds to a re-launched rank's command line (lightning.fabric's _hydra_subprocess_cmd)
RELAUNCH = ['hydra.run.dir="/tmp/a run dir"', "hydra.job.name=train_ddp_process_1", "hydra.output_subdir=null"]
BASE = ["trainer.max_steps=2", "trainer.max_epochs=${oc.env:LA_TEST_EPOCHS,3}"]


def test_a_rank_composes_like_rank_0_despite_its_own_run_dir_and_job_name() -> None:
    rank0 = preflight("gpt-tiny_cpu", BASE)
    environ: dict[str, str] = {"LOCAL_RANK": "1"}
    publish(rank0, environ)
    check_rank(preflight("gpt-tiny_cpu", [*BASE, *RELAUNCH], relaunched=True), environ)
    check_rank(rank0, {})  # nothing published (torchrun starts every process alike): nothing to compare
    assert fingerprint(rank0)["trainer.max_epochs"] == "3"


@pytest.mark.parametrize(("rank_args", "rank_env", "message"), [
    (["trainer.max_steps=3"], {}, r"^rank 1 composes the recipe differently from rank 0: .*trainer.max_steps=3 here, 2 on rank 0"),
    ([], {"LA_TEST_EPOCHS": "5"}, r"^rank 1 composes the recipe differently from rank 0: trainer.max_epochs=5 here, 3 on rank 0; "),
    ([], {"LA_TEST_EPOCHS": "5", "NODE_RANK": "1"}, r"^local rank 1 of node 1 composes the recipe differently"),
])
def test_a_rank_that_composes_differently_is_refused_by_name_before_any_work(
    rank_args: list[str], rank_env: dict[str, str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import re

    environ: dict[str, str] = {}
    publish(preflight("gpt-tiny_cpu", BASE), environ)  # rank 0, before it starts the others
    monkeypatch.setenv(CONFIG_ENV, environ[CONFIG_ENV])
    monkeypatch.setenv(cli.RECIPE_ENV, str(resolve_recipe("gpt-tiny_cpu")))
    monkeypatch.setenv("LOCAL_RANK", "1")
    for key, value in rank_env.items():
        monkeypatch.setenv(key, value)
    overrides = [*BASE[:1], *rank_args, *BASE[1:], *RELAUNCH]
    assert cli.main(overrides) == cli.EXIT_USAGE  # the rank's command line: overrides only, as Lightning re-runs it
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: "), lines
    assert re.search(message, lines[0].removeprefix("lightning-accel: error: ")), lines[0]
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run directory


def test_only_the_hash_travels_for_a_large_config_and_still_refuses() -> None:
    cfg = preflight("gpt-tiny_cpu", BASE)
    environ = {"LOCAL_RANK": "2", CONFIG_ENV: '{"sha256": "0000000000000000"}'}
    with pytest.raises(UserError, match=r"^rank 2 composes the recipe differently from rank 0 \(config hash [0-9a-f]{16} here, 0{16} on rank 0\)"):
        check_rank(cfg, environ)
    assert len(publish(cfg, {})) == 16
