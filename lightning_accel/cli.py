"""The ``lightning-accel`` command: run and bench here; ls, cp, validate, estimate, export in :mod:`lightning_accel.commands`.

With no arguments it runs the embedded default recipe. ``run`` hands the recipe and the
overrides to Hydra unchanged, so everything a Hydra user knows works (``-m`` multirun,
sweepers, launchers, ``--cfg job``); before that it composes the recipe once and checks
it (targets, values, hardware, data files), so bad input ends in one line and exit
status 2 before Hydra makes a run directory. What gets past those checks (an error in a
strategy's set-up, a step, a checkpoint write) ends in one line too, exit status 1: the
traceback is in the run's log, ``run.json`` says ``failed`` (see :mod:`lightning_accel.runner`).
Every command ends a bad argument in one line: argparse's usage errors (ours and each benchmark's) too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from lightning_accel.commands import cmd_cp, cmd_estimate, cmd_export, cmd_ls, cmd_validate

DEFAULT_RECIPE = "gpt-tiny_cpu"
EXIT_USAGE = 2
EXIT_FAILED = 1  # the input passed the checks, the run (or a check itself) failed
# Lightning starts each extra DDP rank by re-running this command with the overrides
# only (plus hydra.run.dir=...); the recipe travels to those ranks in this variable.
RECIPE_ENV = "LIGHTNING_ACCEL_RECIPE"
_COMMANDS = ("run", "ls", "cp", "validate", "bench", "export", "estimate", "-h", "--help")


def _fail(message: str) -> int:
    print(f"lightning-accel: error: {message}", file=sys.stderr)
    return EXIT_USAGE


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose usage error (the usage, wrapped over up to 20 lines, then the error) is our one line."""

    def error(self, message: str) -> NoReturn:
        command = "" if self.prog == "lightning-accel" else f"{self.prog}: "  # a subcommand's or a benchmark's name
        self.exit(EXIT_USAGE, f"lightning-accel: error: {command}{message}; see {self.prog} --help\n")


@contextlib.contextmanager
def _one_line_usage() -> Iterator[None]:
    """A benchmark's own ``argparse.ArgumentParser`` errors in :class:`OneLineParser`'s one line, while it parses."""
    error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = OneLineParser.error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = error  # type: ignore[method-assign]


def cmd_run(recipe: str, args: Sequence[str]) -> int:
    import hydra

    from omegaconf import OmegaConf

    from lightning_accel.config.compose import resolve_recipe, searchpath_override
    from lightning_accel.config.pretrained import RUN_OVERRIDE, takes_directory_config
    from lightning_accel.config.preflight import is_sweep, preflight
    from lightning_accel.config.ranks import CONFIG_ENV, check_rank, publish
    from lightning_accel.config.schema import register_schemas
    from lightning_accel.runner import RunFailed, task

    args = list(args)
    hydra_flags = [a for a in args if a.startswith("-")]
    # Hydra's inspection flags: let Hydra answer, nothing runs, nothing to check
    check = not any(f in ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve") for f in hydra_flags)
    path = resolve_recipe(recipe)
    relaunched = bool(os.environ.get(RECIPE_ENV))  # a DDP or pipeline rank that rank 0 started
    published = False
    if check:
        # every rank checks its own composition (cheap: the network on meta), before any process group exists
        notes: list[str] = []
        cfg = preflight(str(path), args, relaunched=relaunched, notes=notes)
        if takes_directory_config(cfg) and RUN_OVERRIDE not in args:
            args.append(RUN_OVERRIDE)  # the run composes what was checked: the directory's config, not the recipe's
        if not relaunched:
            for note in notes:
                print(f"lightning-accel: {note}", flush=True)
        if relaunched:
            check_rank(cfg)  # the same as rank 0's, or refused by name
        else:
            given = [a for a in args if a.split("=", 1)[0] == "ckpt_path"]
            if cfg.get("ckpt_path") is not None and (not given or given[-1].split("=", 1)[1] == "last"):
                # Every rank and trial resumes from the file preflight checked, not a newer one (a requeued SLURM job's
                # too, which preflight found without a ckpt_path given).
                args.append(f"ckpt_path='{cfg.ckpt_path}'")
            os.environ.pop(CONFIG_ENV, None)  # an earlier run's, in this process
            multirun = str(OmegaConf.select(cfg, "hydra.mode", default="")).endswith("MULTIRUN")
            if not (multirun or any(a in ("-m", "--multirun") or is_sweep(a) for a in args)):
                publish(cfg)  # a sweep's trials compose differently from this: each trial's ranks are its own
                published = True
    claimed = _claim_run_dir(cfg, args) if check and not relaunched else None
    register_schemas()  # the ConfigStore schemas, in this process (a re-launched rank too)
    os.environ[RECIPE_ENV] = str(path)
    # Keep argv[0]: Lightning re-runs it (the console script's path, or -m lightning_accel)
    # to start the other ranks.
    searchpath = searchpath_override()
    # -m between two overrides would split Hydra's list of overrides in two (argparse: "unrecognized arguments")
    flags = [a for a in args if a in _HYDRA_FLAGS]
    sys.argv = [sys.argv[0], *flags, *[a for a in args if a != searchpath and a not in _HYDRA_FLAGS], searchpath]
    app = hydra.main(version_base="1.3", config_path=str(path.parent), config_name=path.stem)(task)
    try:
        app()
    except RunFailed as failed:  # recorded by the runner; rank 0 speaks for a multi-process run
        if failed.rank == 0:
            print(f"lightning-accel: error: {failed.line}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if published:  # the ranks this run started have read it
            os.environ.pop(CONFIG_ENV, None)
        if claimed is not None:
            with contextlib.suppress(OSError):
                claimed.rmdir()  # only when Hydra stopped before writing anything in it
    return 0


def _claim_run_dir(cfg: Any, args: list[str]) -> Any:
    """The run (or sweep) directory Hydra would name from the clock, made by an exclusive create
    (:func:`lightning_accel.run_dir.claim_run_dir`) and handed to Hydra as ``hydra.run.dir`` (``hydra.sweep.dir``), so
    no two runs share one: a run directory the user named (``hydra.run.dir=...``) too, which another run holding it makes
    ``<dir>_1``. A sweep directory the user named is used as given: a sweep resumes there (Optuna's study), and each of
    its trials has a numbered directory of its own."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from lightning_accel.config.preflight import is_sweep
    from lightning_accel.run_dir import claim_run_dir

    multirun = any(a in _HYDRA_FLAGS or is_sweep(a) for a in args) or str(OmegaConf.select(cfg, "hydra.mode", default="")).endswith("MULTIRUN")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if multirun and any(a.lstrip("+").split("=", 1)[0] == key for a in args):
        return None  # a sweep the user points at its directory resumes there (Optuna's study); its trials get their own
    try:
        where = Path(str(OmegaConf.select(cfg, key))).expanduser()
    except Exception:  # an interpolation only Hydra's run resolves: Hydra makes it
        return None
    claimed = claim_run_dir(where)
    quoted = str(claimed).replace("\\", "\\\\").replace("'", "\\'")
    args.append(f"{key}='{quoted}'")
    return claimed


def cmd_bench(name: str | None, args: Sequence[str]) -> int:
    from lightning_accel.bench import load_benchmarks, run_benchmark

    if name is None:
        benchmarks = load_benchmarks()
        for bench_name, (purpose, _) in sorted(benchmarks.items()):
            print(f"{bench_name:<12} {purpose}")
        if not benchmarks:
            print("no benchmarks are installed yet")
        return 0
    with _one_line_usage():
        return run_benchmark(name, list(args))


# Hydra's flags that take no value: a Hydra user writes them before the config's name too
# (``run -m RECIPE a=1,2``); argparse would take them for ours, so they move after the recipe.
_HYDRA_FLAGS = ("-m", "--multirun")


def _recipe_first(args: list[str]) -> list[str]:
    """``run``'s arguments with Hydra's value-less flags that precede the recipe moved after it."""
    lead = 0
    while lead < len(args) and args[lead] in _HYDRA_FLAGS:
        lead += 1
    if lead == 0 or lead == len(args):
        return args
    return [args[lead], *args[:lead], *args[lead + 1 :]]


def _is_override(arg: str) -> bool:
    """A Hydra override (``key=value``, ``+key=value``, ``~key``), not a recipe name."""
    return "=" in arg or arg.startswith("~")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="lightning-accel",
        description="Run, list, copy, validate and benchmark lightning_accel recipes; export a fine-tune's adapters. "
        f"With no arguments, runs the default recipe ({DEFAULT_RECIPE}).",
    )
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a recipe with Hydra overrides (-m for multirun)")
    run.add_argument("recipe", help="recipe name (see `ls`) or path to a recipe YAML")
    run.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides, e.g. trainer.max_steps=50")
    sub.add_parser("ls", help="list the recipes")
    cp = sub.add_parser("cp", help="copy a recipe to edit it")
    cp.add_argument("recipe")
    cp.add_argument("dest")
    val = sub.add_parser("validate", help="compose recipes and check every _target_ without training")
    val.add_argument("recipe", nargs="?", help="recipe name or path")
    val.add_argument("--all", action="store_true", help="validate every shipped recipe, each with the overrides given")
    val.add_argument("overrides", nargs="*", help="Hydra overrides to validate with")
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", nargs="?")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    export = sub.add_parser("export", help="write a fine-tune run's adapters in peft's format")
    export.add_argument("run_dir", help="a run directory (outputs/<recipe>/<date_time>) of a recipe with model.adapter")
    export.add_argument("--out", help="where to write them (default: RUN_DIR/adapter)")
    est = sub.add_parser("estimate", help="device and host memory of a recipe by rank and component, and whether it fits")
    est.add_argument("recipe", help="recipe name or path")
    est.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.batch_size=2")
    est.add_argument("--device-memory", help="device size to judge against: 24GB, 80GiB, H100, L4, A100-40GB, TPU v4 (default: the "
                     "device the recipe's purpose states, else this machine's GPU)")
    est.add_argument("--host-memory", help="host size to judge against, e.g. 256GB (default: this machine's available memory)")
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument("--measure", type=int, metavar="STEPS",
                     help="then run STEPS training steps on this machine's GPUs and print torch.cuda.max_memory_allocated "
                          "beside each rank's device figure (exit 1 when one is off by more than 10%%)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(RECIPE_ENV) and (not argv or argv[0] not in _COMMANDS):
        argv = ["run", os.environ[RECIPE_ENV], *argv]  # a DDP rank re-launched by Lightning
    parser = build_parser()
    if not argv:
        argv = ["run", DEFAULT_RECIPE]
    if argv[0] == "run":
        argv = ["run", *_recipe_first(argv[1:])]
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return EXIT_USAGE

    from lightning_accel.config.errors import explain, failure_line
    from lightning_accel.models.import_noise import drop_import_noise

    drop_import_noise()  # before transformers or peft import torchao
    try:
        if ns.command in ("run", "bench"):
            from lightning_accel.console import quiet

            with quiet(bench=ns.command == "bench"):  # no tips or probe lines; every warning that matters shows
                return cmd_run(ns.recipe, ns.overrides) if ns.command == "run" else cmd_bench(ns.name, ns.args)
        if ns.command == "ls":
            return cmd_ls()
        if ns.command == "cp":
            return cmd_cp(ns.recipe, ns.dest)
        if ns.command == "validate":
            from lightning_accel.config.compose import recipe_names

            # with --all every argument is an override (argparse puts the first in ``recipe``)
            given = [*([ns.recipe] if ns.recipe is not None else []), *ns.overrides]
            if ns.all and all(_is_override(a) for a in given):
                return cmd_validate(recipe_names(), given)
            if ns.all or ns.recipe is None:
                return _fail("validate takes one recipe or --all, then overrides; e.g. lightning-accel validate --all trainer.max_steps=10")
            return cmd_validate([ns.recipe], ns.overrides)
        if ns.command == "export":
            return cmd_export(ns.run_dir, ns.out)
        if ns.command == "estimate":
            return cmd_estimate(ns.recipe, ns.overrides, ns.device_memory, ns.host_memory, ns.json, ns.measure)
        raise AssertionError(f"unhandled command {ns.command!r}")  # argparse allows only the commands above
    except Exception as err:  # bad input becomes one line; anything else keeps its traceback, except in run and validate
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        line = explain(err)
        if line is not None:
            return _fail(line)
        if getattr(type(err), "explained", False) is True:  # failed after the work began, what it wrote removed
            print(f"lightning-accel: error: {failure_line(err)}", file=sys.stderr)
            return EXIT_FAILED
        if ns.command not in ("run", "validate"):
            raise
        # every exit of run and validate is one line: here a check (or Hydra) raised what it should have explained
        print(f"lightning-accel: error: {failure_line(err)} (unexpected; HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
