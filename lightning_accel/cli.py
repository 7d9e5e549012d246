"""The ``lightning-accel`` command: run, ls, cp, validate and bench recipes; export a fine-tune's adapters.

With no arguments it runs the embedded default recipe. ``run`` hands the recipe and the
overrides to Hydra unchanged, so everything a Hydra user knows works (``-m`` multirun,
sweepers, launchers, ``--cfg job``); before that it composes the recipe once and checks
it (targets, values, hardware, data files), so bad input ends in one line and exit
status 2 before Hydra makes a run directory. What gets past those checks (an error in a
strategy's set-up, a step, a checkpoint write) ends in one line too, exit status 1: the
traceback is in the run's log, ``run.json`` says ``failed`` (see :mod:`lightning_accel.runner`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

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
            if cfg.get("ckpt_path") is not None and any(a.split("=", 1)[1] == "last" for a in given):
                # Every rank and trial resumes from the file preflight checked, not a newer one.
                args.append(f"ckpt_path='{cfg.ckpt_path}'")
            os.environ.pop(CONFIG_ENV, None)  # an earlier run's, in this process
            multirun = str(OmegaConf.select(cfg, "hydra.mode", default="")).endswith("MULTIRUN")
            if not (multirun or any(a in ("-m", "--multirun") or is_sweep(a) for a in args)):
                publish(cfg)  # a sweep's trials compose differently from this: each trial's ranks are its own
                published = True
    register_schemas()  # the ConfigStore schemas, in this process (a re-launched rank too)
    os.environ[RECIPE_ENV] = str(path)
    # Keep argv[0]: Lightning re-runs it (the console script's path, or -m lightning_accel)
    # to start the other ranks.
    searchpath = searchpath_override()
    sys.argv = [sys.argv[0], *[a for a in args if a != searchpath], searchpath]
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
    return 0


_MISSING_EXTRA = re.compile(r"comes with the (\w+) extra")


def _needs_extra(err: BaseException) -> str | None:
    """The extra a recipe needs when composing it failed for want of one, else None."""
    from lightning_accel.config.errors import explain

    match = _MISSING_EXTRA.search(explain(err) or "")
    return match.group(1) if match else None


def _extras_of(cfg: object) -> list[str]:
    """The extras a composed recipe uses (its sweeper or launcher plugin)."""
    from omegaconf import OmegaConf

    sweeper = str(OmegaConf.select(cfg, "hydra.sweeper._target_", default="") or "")
    launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    return [*(["sweep"] if "optuna" in sweeper.lower() else []), *(["slurm"] if "submitit" in launcher.lower() else [])]


def cmd_ls() -> int:
    from lightning_accel.config.compose import compose_recipe, recipe_names
    from lightning_accel.config.validate import devices_needed

    rows = [("recipe", "model", "accelerator", "techniques", "purpose")]
    for name in recipe_names():
        try:
            cfg = compose_recipe(name, with_hydra=True)
        except Exception as err:
            extra = _needs_extra(err)
            if extra is None:
                raise
            rows.append((name, "-", "-", "-", f'(needs the {extra} extra: pip install "lightning-accel[{extra}]")'))
            continue
        choices = cfg.hydra.runtime.choices
        net = cfg.model.get("net") or {}
        # the zoo's preset, a transformers config's model_type, or a litgpt config name
        variant = net.get("preset") or (net.get("config") or {}).get("model_type") or net.get("name") or ""
        model = f"{choices.get('model')}:{variant}".rstrip(":") + _param_count(net)
        accel = f"{cfg.trainer.accelerator}x{devices_needed(cfg)}"
        techniques = ",".join(cfg.recipe.techniques) or "-"
        extras = "".join(f" [{e} extra]" for e in _extras_of(cfg))
        rows.append((name, model, accel, techniques, str(cfg.recipe.purpose) + extras))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    return 0


def _param_count(net_cfg: object) -> str:
    """`` (5.4B)``: the network's size, built on the meta device (no memory, no time)."""
    import torch
    from hydra.utils import instantiate

    try:
        with torch.device("meta"):
            net = instantiate(net_cfg, _convert_="all")
        count = sum(p.numel() for p in net.parameters())
    except Exception:  # a user network that cannot be built this way: leave the size out
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f" ({count / scale:.1f}{unit})"
    return f" ({count})"


def cmd_cp(recipe: str, dest: str) -> int:
    from lightning_accel.config.compose import resolve_recipe
    from lightning_accel.config.errors import UserError

    source = resolve_recipe(recipe)
    target = os.path.join(dest, source.name) if os.path.isdir(dest) else dest
    if not target.endswith((".yaml", ".yml")):
        raise UserError(f"destination '{dest}' must be a directory or a .yaml file; e.g. lightning-accel cp {recipe} my_{recipe}.yaml")
    if os.path.exists(target):
        raise UserError(f"'{target}' already exists; choose another destination or remove it first")
    shutil.copyfile(source, target)
    print(f"copied {recipe} to {target}; run it with: lightning-accel run {target}")
    return 0


def cmd_validate(recipes: Sequence[str], overrides: Sequence[str]) -> int:
    """Run every check a run would (:func:`preflight`), except this machine's hardware.

    With several recipes, each is checked and reported; a recipe that needs an extra that
    is not installed is skipped with the install line. Exit status 2 if any failed. A recipe
    whose purpose states a device size ("one 24 GB GPU") is estimated too
    (:mod:`lightning_accel.estimate`); a device peak beyond that size is a one-line warning.
    """
    from lightning_accel.config.errors import explain, failure_line
    from lightning_accel.config.preflight import preflight_built

    failed = 0
    for name in recipes:
        try:
            cfg, module = preflight_built(name, overrides, launch=False)
        except Exception as err:
            extra = _needs_extra(err)
            line = explain(err) or failure_line(err)  # a check that raised unexpectedly: its own line
            if extra is not None and len(recipes) > 1:
                print(f"skip  {name}  (needs the {extra} extra: pip install \"lightning-accel[{extra}]\")")
                continue
            if len(recipes) == 1:
                raise
            failed += 1
            print(f"FAIL  {name}  {line}")
            continue
        warning = _device_warning(name, overrides, cfg, module)
        if warning is not None:
            print(f"warn  {name}  {warning}")
        print(f"ok  {name}")
    return EXIT_USAGE if failed else 0


def _device_warning(name: str, overrides: Sequence[str], cfg: DictConfig, module: Any) -> str | None:
    """One line when the recipe's estimated device peak exceeds the device size its purpose states
    ("one 24 GB GPU"); None when it fits, states no size, or runs on the CPU. ``cfg`` and ``module``:
    what preflight composed and built on meta, which the estimate measures instead of checking again."""
    from lightning_accel.estimate import estimate_recipe
    from lightning_accel.estimate.recipe import stated_device_memory
    from lightning_accel.estimate.report import gb

    stated = stated_device_memory(cfg)
    if stated is None or str(cfg.trainer.accelerator) == "cpu":
        return None
    try:
        estimate = estimate_recipe(name, list(overrides), built=(cfg, module))
    except ValueError as err:  # a data module whose batch shape the estimate does not know
        return f"device memory not estimated: {err}"
    if estimate.device_fits is not False:
        return None
    return (f"estimated device peak {gb(estimate.device_peak)} exceeds the {gb(stated)} device the recipe states; "
            f"HINT: lightning-accel estimate {name} shows where it goes")


def cmd_bench(name: str | None, args: Sequence[str]) -> int:
    from lightning_accel.bench import load_benchmarks, run_benchmark

    if name is None:
        benchmarks = load_benchmarks()
        for bench_name, (purpose, _) in sorted(benchmarks.items()):
            print(f"{bench_name:<12} {purpose}")
        if not benchmarks:
            print("no benchmarks are installed yet")
        return 0
    return run_benchmark(name, list(args))


def cmd_export(run_dir: str, out: str | None) -> int:
    """Write a fine-tune run's adapters in peft's format (:mod:`lightning_accel.models.export_adapters`)."""
    from pathlib import Path

    from lightning_accel.models.export_adapters import export_adapters

    target, count, base = export_adapters(Path(run_dir), Path(out) if out is not None else None)
    print(f"exported {count:,} adapter parameters of {run_dir} to {target}; load them with "
          f"peft.PeftModel.from_pretrained(base, '{target}') on {base}")
    return 0


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


def cmd_estimate(
    recipe: str, overrides: Sequence[str], device_memory: str | None, host_memory: str | None, as_json: bool, measure: int | None = None
) -> int:
    """Print the recipe's memory by rank and component, and whether it fits (:mod:`lightning_accel.estimate`); with
    ``measure``, run that many steps on this machine's GPUs and print ``max_memory_allocated`` beside each rank's
    device figure (:mod:`lightning_accel.estimate.measure`; exit 1 when a device is off by more than 10%)."""
    import json

    from lightning_accel.config.errors import UserError
    from lightning_accel.estimate import estimate_recipe, parse_size
    from lightning_accel.estimate.report import device_size

    try:
        sizes = [size(s) if s is not None else None for size, s in ((device_size, device_memory), (parse_size, host_memory))]
    except ValueError as err:
        raise UserError(str(err)) from None
    if measure is not None:
        import torch

        if measure < 1:
            raise UserError(f"--measure takes a number of training steps, 1 or more; got {measure}")
        if not torch.cuda.is_available():
            raise UserError("--measure compares the device figure with torch.cuda.max_memory_allocated: it needs a CUDA GPU")
    estimate = estimate_recipe(recipe, list(overrides), *sizes)
    if measure is None:
        print(json.dumps(estimate.as_json(), indent=2) if as_json else estimate.format())
        return 0
    from lightning_accel.estimate.measure import compare, format_rows, run_and_measure

    if estimate.on_cpu:
        raise UserError(f"{recipe} trains on the CPU: --measure compares a GPU recipe's device figure")
    if not as_json:  # the table first: the run takes minutes
        print(estimate.format(), flush=True)
    rows = compare(estimate, run_and_measure(recipe, list(overrides), measure))
    if as_json:
        print(json.dumps({**estimate.as_json(), "measured": [{**vars(r), "ratio": r.ratio} for r in rows]}, indent=2))
    else:
        print(format_rows(rows))
    return 0 if all(r.within for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        if ns.command not in ("run", "validate"):
            raise
        # every exit of run and validate is one line: here a check (or Hydra) raised what it should have explained
        print(f"lightning-accel: error: {failure_line(err)} (unexpected; HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
