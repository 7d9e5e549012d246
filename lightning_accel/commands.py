"""The commands of ``lightning-accel`` besides ``run`` and ``bench``: ``ls``, ``cp``, ``validate``, ``estimate``, ``export``.

Each reads recipes or runs and writes nothing but what it was asked to write. A bad path or argument ends in one line
and exit status 2 before any work (:class:`~lightning_accel.config.errors.UserError`), checked before the first byte is
written: a ``cp`` destination in a directory that does not exist, an ``export --out`` onto a file. What fails after
the work began (a disk that fills up mid-write) ends in one line and exit status 1 (:class:`CommandFailed`), and what the
command had written is removed: nothing half-made is left behind.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_accel.config.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

EXIT_USAGE = 2


class CommandFailed(Exception):
    """A command that failed after it began writing, its partial output removed: one line, exit status 1."""

    explained = True  # str() is the whole line (config.errors.failure_line shows it as it is)


def writable_parent(key: str, target: Path, make_parents: bool = False) -> Path | None:
    """``target``'s directory exists (or, ``make_parents``, its nearest existing ancestor does), is a directory and can
    be written: checked before anything is written. Returns the outermost directory the write would make (to remove
    if it fails), or None."""
    target = target.expanduser()
    parent, made = target.parent, None
    while make_parents and not parent.exists() and parent != parent.parent:
        parent, made = parent.parent, parent
    if not parent.exists():
        raise UserError(f"{key} '{target}': the directory '{parent}' does not exist; create it first (mkdir -p {parent}) or "
                        "choose an existing directory")
    if not parent.is_dir():
        raise UserError(f"{key} '{target}': '{parent}' is a file, not a directory; choose a path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{key} '{target}': the directory '{parent}' is not writable; choose a directory you can write to")
    return made


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
    """Copy a recipe to edit it; never overwrites, and a destination that cannot be written is refused first."""
    from lightning_accel.config.compose import resolve_recipe

    source = resolve_recipe(recipe)
    target = Path(dest).expanduser() / source.name if os.path.isdir(os.path.expanduser(dest)) else Path(dest).expanduser()
    if target.suffix not in (".yaml", ".yml"):
        raise UserError(f"destination '{dest}' must be a directory or a .yaml file; e.g. lightning-accel cp {recipe} my_{recipe}.yaml")
    if target.exists():
        raise UserError(f"'{target}' already exists; choose another destination or remove it first")
    writable_parent("destination", target)
    try:
        shutil.copyfile(source, target)
    except OSError as err:
        target.unlink(missing_ok=True)
        raise CommandFailed(f"cannot write '{target}': {err.strerror or err} (nothing was left there); choose another "
                            "destination, or free space on that disk if it is full") from err
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


def cmd_estimate(
    recipe: str, overrides: Sequence[str], device_memory: str | None, host_memory: str | None, as_json: bool, measure: int | None = None
) -> int:
    """Print the recipe's memory by rank and component, and whether it fits (:mod:`lightning_accel.estimate`); with
    ``measure``, run that many steps on this machine's GPUs and print ``max_memory_allocated`` beside each rank's
    device figure (:mod:`lightning_accel.estimate.measure`; exit 1 when a device is off by more than 10%)."""
    import json

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


def cmd_export(run_dir: str, out: str | None) -> int:
    """Write a fine-tune run's adapters in peft's format (:mod:`lightning_accel.models.export_adapters`); ``--out`` is
    a directory (made if missing): a file there, or a parent that cannot be written, is refused before any work; a
    write that fails removes what it wrote."""
    from lightning_accel.models.export_adapters import export_adapters

    run = Path(run_dir).expanduser()
    if not run.is_dir():
        what = "is a file, not a directory" if run.exists() else "does not exist"
        raise UserError(f"run directory '{run_dir}' {what}; pass one that `lightning-accel run` made, e.g. outputs/<recipe>/<date_time>")
    target = Path(out).expanduser() if out is not None else run / "adapter"
    if target.exists() and not target.is_dir():
        raise UserError(f"--out '{out}' is a file; peft writes a directory of files (adapter_config.json, adapter_model.safetensors): "
                        "pass a directory, made if missing")
    made = None if target.exists() else writable_parent("--out", target, make_parents=True) or target
    try:
        written, count, base = export_adapters(run, target)
    except UserError:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    except Exception as err:
        from lightning_accel.config.errors import failure_line

        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise CommandFailed(f"cannot export the adapters of {run_dir} to '{target}': {failure_line(err)}"
                            f"{' (nothing was left there)' if made is not None else ''}; fix that and export again") from err
    print(f"exported {count:,} adapter parameters of {run_dir} to {written}; load them with "
          f"peft.PeftModel.from_pretrained(base, '{written}') on {base}")
    return 0


