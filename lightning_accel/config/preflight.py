"""Every check a recipe and its overrides get before any work: :func:`preflight`.

``lightning-accel run`` and ``validate`` (and the sweep path, through :func:`preflight`'s
sweep checks) compose the recipe once and ask the same questions in the same order, so
bad input ends in one line and exit status 2 before Hydra makes a run directory:

1. composition: the YAML parses, every option and key exists, values have their types,
   the groups a run needs (model, data, trainer) are not removed; a ``pretrained_path``
   takes the place of the recipe's model config, what the user set agreeing with it
   (:mod:`lightning_accel.config.pretrained`);
2. binding: every ``_target_`` imports and takes the keys given (:func:`validate`);
3. sweeps: search space keys exist, each listed value composes, the direction and the
   SLURM allocation can be derived (:func:`lightning_accel.sweep.check_sweep`); every job of
   a multirun gets step 5 too, before the first starts (:func:`lightning_accel.sweep.sweep_jobs`);
4. the run on this machine (``launch=True``): the hardware the recipe needs, the data
   files, a writable outputs directory, a run (or sweep) directory Hydra can make;
5. one job (:func:`check_job`): the Trainer's loop values and the seed
   (:mod:`~lightning_accel.config.loop_checks`), every interpolation, then the objects whose
   constructors check their arguments, built once, cheaply (the network on the meta device),
   so their own validation runs and no second copy of it exists here (a transformers
   ``pretrained_path`` is checked there too, without reading a weight); the optimizer and
   scheduler built and stepped once (:mod:`~lightning_accel.config.optim_checks`); the
   strategy's set-up checks, the same functions it calls at set-up, on that network, the
   configured batch size and world size (:func:`lightning_accel.config.setup_checks.check_strategy_setup`);
   and the network against the data's shapes (:mod:`~lightning_accel.config.data_fit`);
6. checkpoints: ``ckpt_path`` (``last`` resolved to a file) is readable, its weights fit the
   network about to be built, and its optimizer and scheduler states are the config's
   (:mod:`~lightning_accel.config.resume_checks`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_accel.config.compose import compose_recipe, resolve_recipe
from lightning_accel.config.data_fit import check_data_fits
from lightning_accel.config.errors import UserError, explain, missing_file_line, one_line
from lightning_accel.config.argument_types import check_argument_types
from lightning_accel.config.host_fit import check_network_fits_host
from lightning_accel.config.loop_checks import check_run_options, check_seed, check_trainer
from lightning_accel.config.optim_checks import Configured, check_optimization
from lightning_accel.config.paths import check_config_paths, check_env_paths
from lightning_accel.config.resume_checks import check_checkpoint
from lightning_accel.config.setup_checks import check_offload_precision, check_strategy_setup
from lightning_accel.config.validate import check_launchable, check_top_level, validate

_REQUIRED_GROUPS = ("model", "data", "trainer")
_COMM_DDP = "lightning_accel.strategies.ddp_comm.CommDDPStrategy"


def is_sweep(override: str) -> bool:
    """``a=1,2`` or ``a=interval(0,1)``: one key, several jobs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override).is_sweep_override()
    except Exception:  # unparsable: composition reports it
        return False


def _first_line(err: BaseException) -> str:
    """The error's first line, in the one shape of :mod:`~lightning_accel.config.errors` (``...; fix``)."""
    return one_line(str(err)) or type(err).__name__


def _compose(path: Path, overrides: Sequence[str], notes: list[str] | None = None) -> DictConfig:
    import yaml

    _check_options(overrides)
    try:
        return compose_recipe(path, overrides, with_hydra=True, notes=notes)
    except UserError:  # our own check at composition (a pretrained_path against the user's config): already one line
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or _first_line(err)
        raise UserError(f"YAML syntax error in {where}: {problem}; fix the file (`lightning-accel cp` gives a working copy)") from None
    except Exception as err:
        line = explain(err)
        if line is not None:
            raise UserError(line) from None
        removed = [o.split("=", 1)[0] for o in overrides if re.fullmatch(r"[\w/]+=null", o)]
        if removed:
            raise UserError(f"{removed[0]}=null removes the {removed[0]} config a run needs; choose an option, e.g. {_example(removed[0])}") from None
        raise UserError(f"cannot compose {path.stem}: {_first_line(err)}; rerun with HYDRA_FULL_ERROR=1 for the traceback") from None


def _check_options(overrides: Sequence[str]) -> None:
    """An option of a config group that does not exist is refused by name: Hydra refuses it itself for most groups, but
    skips an ``optional`` group's (``hparams_search=optuan`` ran without the search, in silence)."""
    from lightning_accel.config.errors import close_matches
    from lightning_accel.config.locate import conf_dir

    for override in overrides:
        match = re.fullmatch(r"\+{0,2}(\w+)=([\w.-]+)", override)
        if match is None or match.group(2) == "null" or not (conf_dir() / match.group(1)).is_dir():
            continue
        group, option = match.groups()
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml") if p.stem != "base")
        if options and option not in options:
            raise UserError(f"unknown {group} option {option!r}{close_matches(option, options)}; "
                            f"choose one of: {', '.join(options)} (e.g. {group}={options[0]})")


def _example(group: str) -> str:
    from lightning_accel.config.locate import conf_dir

    options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")) if (conf_dir() / group).is_dir() else []
    return f"{group}={options[0]}" if options else f"{group}=<option>"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's start-up lines (GPU available: ...) belong to the run, not to the check."""
    logger = logging.getLogger("lightning")
    loggers = [logger, logging.getLogger("lightning.pytorch"), logging.getLogger("lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _cause(err: BaseException) -> BaseException:
    """The constructor's error, seen through Hydra's InstantiationException."""
    while err.__cause__ is not None and type(err).__name__ == "InstantiationException":
        err = err.__cause__
    return err


def _reason(err: BaseException) -> str:
    """The one line of a constructor's error."""
    err = _cause(err)
    return explain(err) or _first_line(err)


def _built(where: str, node: Any, **kwargs: Any) -> Any:
    """``instantiate(node)``, its error as one line naming ``where`` (and the argument, where the constructor's
    error names one: :mod:`lightning_accel.strategies.options_check`'s ``where.name=value: ...``)."""
    try:
        built = instantiate(node, **kwargs)
    except UserError:
        raise
    except Exception as err:
        keyed = getattr(_cause(err), "keyed", None)
        raise UserError(keyed(where) if callable(keyed) else _with_fix(where, node, _reason(err))) from None
    check_argument_types(where, node)  # what its constructor took without a check of its own (data.seed=abc)
    return built


def _with_fix(where: str, node: Any, line: str) -> str:
    """A constructor's line, keyed: ``where.key=value: line`` when it names one of the node's settings (nested too:
    ``model.net.dropout``), else ``where: line``; a line that says no fix (no ``;``) gets one, the key to change."""
    if re.match(r"^[+~]*\w+\.[\w.\[\]]+=", line):  # already names its dotted key (our own checks' lines)
        return line
    try:
        flat = dict(_leaves(OmegaConf.to_container(node, resolve=True), where)) if OmegaConf.is_dict(node) else {}
    except Exception:  # an interpolation that does not resolve here: the line as it is
        flat = {}
    found = {k: m.start() for k in flat if (m := re.search(rf"\b{re.escape(k.rsplit('.', 1)[-1])}\b", line))}
    if found:
        key = min(found, key=lambda k: (found[k], len(k)))  # the setting the line names first
        return f"{key}={flat[key]}: {line}" + ("" if ";" in line else f"; set {key} to a value it allows")
    if ";" in line:
        return f"{where}: {line}"
    return f"{where}: {line}; fix the {where} arguments ({', '.join(k.rsplit('.', 1)[-1] for k in flat) or 'its _target_'})"


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """The settings of a node as ``(dotted key, value)``, Hydra's own keys (``_target_``) left out."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not str(key).startswith("_"):
                yield from _leaves(value, f"{prefix}.{key}")
    else:
        yield prefix, node


def check_comm_strategy(strategy: Mapping[str, Any] | None, accelerator: str) -> None:
    """Refuse a comm hook the strategy would ignore or the accelerator cannot run.

    ``strategy`` is the composed ``cfg.strategy`` node (a mapping), ``accelerator`` is
    ``cfg.trainer.accelerator``.
    """
    from lightning_accel.comm.hooks import CommHookSpec, check_comm_hook

    if not strategy:
        return
    target = str(strategy.get("_target_") or "")
    lightning_hook = strategy.get("ddp_comm_hook")
    if lightning_hook is not None and target != _COMM_DDP and accelerator == "cpu":
        raise UserError(
            f"strategy.ddp_comm_hook is set but {target or 'the strategy'} registers DDP comm hooks only on CUDA, and "
            "trainer.accelerator=cpu: gradients would silently go out uncompressed; use strategy=ddp_fp16 or "
            "strategy=ddp_powersgd (CommDDPStrategy registers them on every device)"
        )
    if "comm_hook" not in strategy:
        return
    if target != _COMM_DDP:
        raise UserError(
            f"strategy.comm_hook={strategy['comm_hook']} needs a DDP strategy, but strategy._target_ is "
            f"{target or '(a strategy name)'}; choose strategy=ddp_fp16, ddp_bf16 or ddp_powersgd"
        )
    spec = CommHookSpec(
        str(strategy["comm_hook"]),
        int(strategy.get("powersgd_rank", 1)),
        int(strategy.get("powersgd_start_iter", 2)),
        bool(strategy.get("powersgd_fp16", False)),
    )
    check_comm_hook(spec, device_type=accelerator)


@contextlib.contextmanager
def _hydra_runtime(cfg: DictConfig, output_dir: Path) -> Iterator[None]:
    """``${hydra:runtime.output_dir}`` resolvable outside a run, for the constructors that
    take paths in it (ModelCheckpoint's dirpath); nothing is created there."""
    from hydra.core.hydra_config import HydraConfig

    previous = HydraConfig.instance().cfg
    staged = cfg.copy()
    with open_dict(staged):
        staged.hydra.runtime.output_dir = str(output_dir)
    HydraConfig.instance().set_config(staged)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = previous


def _strategy_node(cfg: DictConfig, launch: bool) -> Any:
    """The strategy config to build; for ``validate`` on a machine without the stage devices
    a recipe lists, the same stages on the CPU (the hardware is check_launchable's question)."""
    import torch

    node = cfg.strategy
    stages = node.get("devices")
    if launch or not OmegaConf.is_list(stages):
        return node
    cuda = [d for d in stages if str(d).startswith("cuda")]
    if len(cuda) <= torch.cuda.device_count():
        return node
    node = node.copy()
    node.devices = ["cpu" if str(d).startswith("cuda") else d for d in stages]
    return node


def _check_objects(cfg: DictConfig, launch: bool) -> tuple[Any, Configured]:
    """Build what checks its own arguments; returns the network (on the meta device) and what its
    ``configure_optimizers`` built there (stepped once)."""
    import torch

    from lightning_accel.runner import build_model

    with _quiet():
        has_target = cfg.get("strategy") is not None and "_target_" in cfg.strategy
        strategy = _built("strategy", _strategy_node(cfg, launch)) if has_target else None
        for name, node in (cfg.get("callbacks") or {}).items():
            if node is not None:
                _built(f"callbacks.{name}", node)
        plugins = [_built(f"plugins[{i}]", node) for i, node in enumerate(cfg.get("plugins") or [])]
        check_offload_precision(strategy, plugins, cfg.trainer.get("precision"))
        with torch.device("meta"):
            try:
                module = build_model(cfg)
            except UserError:
                raise
            except Exception as err:
                raise UserError(_with_fix("model", cfg.model, _reason(err))) from None
        optimization = check_optimization(module, cfg)
        check_argument_types("model", cfg.model)  # what the network's and the optimizer's constructors took unchecked
    check_strategy_setup(strategy, module, cfg, optimization.optimizers)
    return module, optimization


def _check_writable(root: Path) -> None:
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"outputs directory '{root}' cannot be created: '{existing}' is not a writable directory; set LIGHTNING_ACCEL_OUTPUTS=<a writable path>")


def recipe_root(cfg: DictConfig, recipe_path: Path) -> Path:
    """Where this recipe's runs live: ``<paths.root_dir>/<recipe>``."""
    return Path(str(cfg.paths.root_dir)).expanduser() / recipe_path.stem


def preflight(recipe: str, overrides: Sequence[str], *, launch: bool = True, relaunched: bool = False,
              notes: list[str] | None = None) -> DictConfig:
    """Compose ``recipe`` with ``overrides`` once and run every check (see the module doc).

    Returns the composed config (Hydra's node included); ``ckpt_path=last`` comes back as
    the checkpoint file it resolved to. ``launch=False`` (``validate``) skips what only a
    run on this machine needs: hardware and a writable outputs directory. ``relaunched``: a
    rank that rank 0 started (:mod:`lightning_accel.config.ranks`): earlier runs are left to
    rank 0 to reap (its own run is already under way there). ``notes`` gets the lines a run prints about what
    composition changed (a ``pretrained_path``'s config replacing the recipe's).
    """
    return preflight_built(recipe, overrides, launch=launch, relaunched=relaunched, notes=notes)[0]


def preflight_built(recipe: str, overrides: Sequence[str], *, launch: bool = True, relaunched: bool = False,
                    notes: list[str] | None = None) -> tuple[DictConfig, Any]:
    """:func:`preflight`, and the LightningModule its checks built on the meta device from the
    config it returns: ``estimate`` measures that one instead of building it again (a 70B
    LoRA's build, peft's injection on meta, takes seconds)."""
    from lightning_accel.run_dir import find_last_checkpoint, reap, requeued_checkpoint
    from lightning_accel.sweep import check_sweep, sweep_jobs

    check_env_paths()  # an empty LIGHTNING_ACCEL_OUTPUTS would put the run at the file system's root
    path = resolve_recipe(recipe)
    flags = [o for o in overrides if o.startswith("-")]
    plain = [o for o in overrides if not o.startswith("-") and not is_sweep(o)]
    cfg = _compose(path, plain, notes)
    for group in _REQUIRED_GROUPS:
        if cfg.get(group) is None:
            raise UserError(f"{group} is empty ({group}=null?); a run needs one, e.g. {_example(group)}")
    run_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    validate(run_cfg)
    remote = check_sweep(path, [*flags, *[o for o in overrides if not o.startswith("-")]], cfg)
    # a rank that rank 0 started runs one job: rank 0 checked the others
    jobs = None if relaunched else sweep_jobs(cfg, [o for o in overrides if not o.startswith("-")], multirun=any(f in ("-m", "--multirun") for f in flags))
    if launch and not remote:  # jobs sent to SLURM run on its nodes, not on this machine
        check_launchable(cfg, path.stem)
        check_config_paths(cfg)  # every path-valued key: the outputs, the cache, checkpoints' dirpath, nvme_path, pretrained_path
        _check_writable(recipe_root(cfg, path))
        check_run_dir(cfg, multirun=jobs is not None)
    module, optimization = check_job(cfg, path, launch)
    for number, job in enumerate(jobs or [], start=1):  # every job of a multirun, before the first starts
        try:
            check_job(_compose(path, [*plain, *job]), path, launch)
        except UserError as err:
            raise UserError(f"multirun job {number} of {len(jobs or [])} ({' '.join(job)}): {err}") from None
    ckpt_path = cfg.get("ckpt_path")
    if launch and not relaunched and recipe_root(cfg, path).is_dir():
        reap(recipe_root(cfg, path))  # earlier runs that died: marked killed, their last.ckpt made true
    if ckpt_path is None and launch and not relaunched and _requeued_job() is not None and recipe_root(cfg, path).is_dir():
        # a SLURM job requeued by its requeue signal (SLURMEnvironment(auto_requeue=True)) continues where it stopped
        found = requeued_checkpoint(recipe_root(cfg, path), str(_requeued_job()))
        if found is not None:
            ckpt_path = str(found)
            with open_dict(cfg):
                cfg.ckpt_path = ckpt_path
            if notes is not None:
                notes.append(f"requeued SLURM job {_requeued_job()}: resuming from {found}")
    if ckpt_path == "last":
        ckpt_path = str(find_last_checkpoint(recipe_root(cfg, path), cfg))
        with open_dict(cfg):
            cfg.ckpt_path = ckpt_path
    if ckpt_path is not None:
        if not Path(str(ckpt_path)).is_file():
            raise UserError(missing_file_line("ckpt_path", ckpt_path, "pass an existing .ckpt file, ckpt_path=last, or leave it unset"))
        check_checkpoint(str(ckpt_path), module, optimization, cfg)
    return cfg, module


def _requeued_job() -> str | None:
    """This SLURM job's id when SLURM has restarted it (``SLURM_RESTART_COUNT`` above 0), else None."""
    from lightning_accel.callbacks.graceful_interrupt import slurm_job_id

    restarts = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    return slurm_job_id() if restarts.isdigit() and int(restarts) > 0 else None


def check_job(cfg: DictConfig, path: Path, launch: bool) -> tuple[Any, Configured]:
    """Every check of one job's composed config that builds something: the data module, the strategy and the other
    constructors, the loop, the network on meta and its optimization, the network against the data."""
    check_top_level(cfg)
    with _hydra_runtime(cfg, recipe_root(cfg, path) / "(preflight)"):
        # the loop first: other nodes read its values by interpolation (every_n_train_steps: ${trainer.val_check_interval})
        with _quiet():
            check_trainer(_resolved(cfg.trainer))
        check_seed(cfg.get("seed"))
        check_run_options(cfg)
        _resolved(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]))  # every interpolation, its key named
        data = check_data(cfg)
        check_comm_strategy(cfg.get("strategy"), str(cfg.trainer.accelerator))
        module, optimization = _check_objects(cfg, launch)
    check_data_fits(data, module, cfg)
    if launch:  # validate checks a recipe for any machine; run, for this one
        check_network_fits_host(module, cfg)
    return module, optimization


def _resolved(node: DictConfig) -> Any:
    """``node`` as plain data, every interpolation resolved; one that does not resolve is refused naming its key."""
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception as err:
        line = explain(err)
        if line is None:
            raise
        raise UserError(line) from None


def check_run_dir(cfg: DictConfig, multirun: bool) -> None:
    """The directory Hydra will make for the run (``hydra.run.dir``, or ``hydra.sweep.dir`` for a multirun): a path
    that is a file, or under one, or under a directory this user cannot write, is refused before Hydra tries."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        where = Path(str(OmegaConf.select(cfg, key))).expanduser()
    except Exception:  # an interpolation only Hydra's run resolves: Hydra makes it and says so
        return
    if where.exists() and not where.is_dir():
        raise UserError(f"{key}='{where}' is a file, not a directory; point {key} at a directory (made if missing), or leave it unset")
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "a file" if existing.exists() and not existing.is_dir() else "not writable"
        raise UserError(f"{key}='{where}' cannot be made: '{existing}' is {what}; point {key} at a writable directory, or leave it unset")


def check_data(cfg: DictConfig) -> Any:
    """Build the data module: cheap (no data is read before ``setup``) and where a bad
    argument or a missing user file is reported; returned for the checks against the model."""
    return _built("data", cfg.data)


__all__ = ["check_checkpoint", "check_comm_strategy", "check_data", "check_job", "check_offload_precision", "check_run_dir", "is_sweep", "preflight",
           "preflight_built", "recipe_root"]
