"""Hyper-parameter sweeps: up-front checks of a search space and the best-trial summary.

A sweep (``lightning-accel run RECIPE hparams_search=optuna_lr_batch``) runs one Hydra
job per trial, each returning ``cfg.optimized_metric``'s final value. Two things Hydra
does not do for us live here:

- :func:`check_sweep` looks at the search space *before any trial starts*: a key that is
  not in the composed config would otherwise be added silently (or fail in trial 1 after
  minutes of work, or, worse, after the previous trials' time has been spent).
- :class:`SweepSummary`, a Hydra callback, makes the sweep directory early (the Optuna
  study's SQLite file lives there, so a sweep can be resumed with
  ``hydra.sweep.dir=<that dir>``) and prints which trial won, with what, and where its
  run directory is, when the sweep ends.

The ``sweep_direction`` resolver derives the Optuna direction from the metric's name, so a
recipe that optimizes ``val/acc`` maximizes without anyone remembering to say so.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from lightning_accel.config.errors import UserError, close_matches

# Metric names (the part after the last "/") that are better when larger / smaller.
_MAXIMIZE = re.compile(r"(acc|accuracy|f1|auroc|auc|precision|recall|iou|map|bleu|rouge|r2|score)(_|$)")
_MINIMIZE = re.compile(r"(loss|ppl|perplexity|err|error|mse|mae|rmse|nll|bpc|bpb|wer|cer)(_|$)")


def metric_direction(metric: str) -> str:
    """``"minimize"`` or ``"maximize"`` for a metric name such as ``val/loss`` or ``val/acc``."""
    name = str(metric).rsplit("/", 1)[-1].lower()
    if _MINIMIZE.search(name):
        return "minimize"
    if _MAXIMIZE.search(name):
        return "maximize"
    raise UserError(
        f"cannot tell whether to minimize or maximize optimized_metric={metric!r}; "
        "set the direction yourself: hydra.sweeper.direction=minimize (or maximize)"
    )


OmegaConf.register_new_resolver("sweep_direction", metric_direction, replace=True)


# --------------------------------------------------------------------------- checks


def _leaf_keys(node: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from _leaf_keys(value, path)


def check_search_space(cfg: DictConfig, params: Mapping[str, Any], *, groups: Iterable[str] = ()) -> None:
    """Refuse a search space over a key the composed ``cfg`` does not have.

    ``params`` maps override keys to their sweep (``{"model.optimizer.lr": "interval(...)"}``).
    A key written ``+key`` adds a new key on purpose and is allowed here (:func:`check_added_keys`
    composes it); ``~key`` removes one, which must exist; ``hydra.*`` keys configure Hydra itself,
    except the search space's own (``+hydra.sweeper.params.K=interval(...)``, written as Hydra
    users often write a search dimension: each trial would set Hydra's key and ``K`` would not
    change); ``groups`` are config-group names (``model``, ``precision``) whose options were
    already checked by composition.
    """
    group_names = set(groups)
    known: list[str] | None = None
    for raw_key in params:
        text = str(raw_key)
        key = text.lstrip("+~")
        if key.startswith(_OWN_PARAMS):
            _refuse_own_params(cfg, text, key[len(_OWN_PARAMS):], params[raw_key], group_names)
        if text.startswith("+") or key.startswith("hydra.") or key in group_names:
            continue
        if "/" in key or "@" in key:  # group selections (hydra/launcher, db@x): composition checks them
            continue
        if OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False) is not _ABSENT:
            continue
        if known is None:
            known = list(_leaf_keys(OmegaConf.to_container(cfg, resolve=False)))
        fix = "or remove the ~ entry" if text.startswith("~") else f"or write +{key} to add a new key"
        raise UserError(
            f"search space key {text!r} does not exist in the composed config{close_matches(key, known)}; "
            f"fix it in hydra.sweeper.params or on the command line, {fix}"
        )


_OWN_PARAMS = "hydra.sweeper.params."


def _refuse_own_params(cfg: DictConfig, text: str, inner: str, value: Any, groups: set[str]) -> None:
    """A sweep over ``[+|~]hydra.sweeper.params.K``: the key ``K`` it means is checked first (a misspelling is named),
    then the form is refused with the one that sweeps ``K``."""
    if not inner.lstrip("+~").startswith("hydra."):
        check_search_space(cfg, {inner: value}, groups=groups)
    raise UserError(
        f"search space key {text!r} sweeps Hydra's own config: each trial would set hydra.sweeper.params.{inner} and "
        f"{inner.lstrip('+~')} would not change; write {inner}={value} (a search dimension on the command line), or "
        f"put it under hydra.sweeper.params in the recipe"
    )


def check_added_keys(recipe: str | Path, plain: Sequence[str], params: Mapping[str, Any]) -> None:
    """Compose each ``+key`` (and ``++key``) of the search space with one of its values and bind the result
    (:func:`lightning_accel.config.validate.validate`): an added key the class it lands in does not take
    (``+model.optimizer.lrr``) is refused before trial 1, not in it. ``plain``: the non-sweep overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_accel.config.compose import compose_recipe
    from lightning_accel.config.errors import explain
    from lightning_accel.config.validate import validate

    parser = OverridesParser.create()
    for raw_key, spec in params.items():
        key = str(raw_key)
        if not key.startswith("+") or key.lstrip("+").startswith("hydra."):
            continue
        try:
            override = parser.parse_override(f"{key}={spec}")
            value = override.value()
            sample = next(iter(override.sweep_string_iterator())) if override.is_discrete_sweep() else getattr(value, "start", spec)
            cfg = compose_recipe(recipe, [*plain, f"{key}={sample}"])
            validate(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]))
        except UserError as err:
            raise UserError(f"search space key {key!r}: {err}") from None
        except Exception as err:
            line = explain(err) or str(err).strip().splitlines()[0]
            raise UserError(f"search space key {key!r} ({key}={spec}) is refused: {line}") from None


_ABSENT = object()


def sweep_params(hydra_cfg: DictConfig | None, overrides: Sequence[str]) -> dict[str, str]:
    """The search space of a sweep: ``hydra.sweeper.params`` plus sweep overrides (``a=1,2``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params: dict[str, str] = {}
    configured = OmegaConf.select(hydra_cfg, "sweeper.params") if hydra_cfg is not None else None
    if configured:
        params.update({str(k): str(v) for k, v in configured.items()})
    parser = OverridesParser.create()
    for text in overrides:
        if text.startswith("-"):
            continue
        override = parser.parse_override(text)
        if override.is_sweep_override():
            key = override.get_key_element()  # keeps a leading + / ++ / ~ and an @package
            params[key] = text.split("=", 1)[1]
    return params


def check_sweep(recipe: str | Path, overrides: Sequence[str], cfg: DictConfig | None = None) -> bool:
    """Everything a sweep or launch needs that composition does not check, before any trial.

    ``cfg`` is ``recipe`` composed with the non-sweep ``overrides``, Hydra's own config
    included (so an unknown sweeper or launcher already failed there, in one line);
    :func:`lightning_accel.config.preflight.preflight` passes the one it composed. This
    checks that the search space keys exist, that each value a sweep lists composes
    (``trainer.max_steps=abc,2`` fails here, not in trial 1), that the direction can be
    derived from ``optimized_metric``, and that a SLURM allocation can be sized. Returns
    True when the jobs will run on other machines (SLURM): this machine's hardware then
    says nothing about the run, and the caller should skip its local hardware check.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_accel.config.locate import conf_dir

    parser = OverridesParser.create()
    texts = [o for o in overrides if not o.startswith("-")]
    if cfg is None:
        from lightning_accel.config.compose import compose_recipe

        cfg = compose_recipe(recipe, [o for o in texts if not parser.parse_override(o).is_sweep_override()], with_hydra=True)
    hydra_cfg = cfg.hydra
    params = sweep_params(hydra_cfg, texts)
    multirun = str(OmegaConf.select(hydra_cfg, "mode", default="")).endswith("MULTIRUN") or "-m" in overrides or "--multirun" in overrides
    if not params and not multirun:
        return False  # a single run: Hydra uses no sweeper or launcher
    groups = [p.name for p in conf_dir().iterdir() if p.is_dir()]
    with_hydra_removed = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    check_search_space(with_hydra_removed, params, groups=groups)
    plain = [o for o in texts if not parser.parse_override(o).is_sweep_override()]
    check_sweep_values(recipe, plain, texts)
    check_added_keys(recipe, plain, params)
    launcher = str(OmegaConf.select(hydra_cfg, "launcher._target_", default="") or "")
    remote = launcher.endswith("SlurmLauncher")
    if remote:
        check_slurm_devices(cfg.trainer.devices)
    sweeper = OmegaConf.select(hydra_cfg, "sweeper._target_", default="") or ""
    if "optuna" in sweeper.lower():
        direction = OmegaConf.to_container(hydra_cfg.sweeper, resolve=False).get("direction")
        if isinstance(direction, str) and "sweep_direction" in direction:  # derived: check it can be
            metric_direction(str(cfg.optimized_metric))
    return remote


def check_sweep_values(recipe: str | Path, plain: Sequence[str], overrides: Sequence[str]) -> None:
    """Compose once per value of each listed sweep (``a=1,2``, ``a=range(1,4)``), so a value
    of the wrong type or an unknown option is refused before the first trial."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_accel.config.compose import compose_recipe
    from lightning_accel.config.errors import explain

    parser = OverridesParser.create()
    for text in overrides:
        override = parser.parse_override(text)
        if not override.is_sweep_override() or not override.is_discrete_sweep():
            continue
        key = override.get_key_element()
        for value in override.sweep_string_iterator():
            try:
                compose_recipe(recipe, [*plain, f"{key}={value}"])
            except Exception as err:
                line = explain(err) or str(err).strip().splitlines()[0]
                raise UserError(f"sweep value {key}={value} (from {text}) is refused: {line}") from None


# A basic sweep of at most this many jobs is checked job by job; a larger one, and a sampling sweeper's (Optuna's), value
# by value: each listed value once (an interval by its two bounds), the other keys at their first.
_MAX_PRODUCT = 24


def sweep_jobs(cfg: DictConfig, overrides: Sequence[str], multirun: bool = False) -> list[list[str]] | None:
    """The jobs of a multirun as override lists, for preflight to check every job's composition before the first
    starts (a second value that only its constructor refuses, ``model.optimizer.lr=1e-3,-1``, would otherwise fail
    job 1 after job 0 trained); None for a single run. ``cfg``: the recipe composed with the non-sweep overrides."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_cfg = cfg.get("hydra")
    params = {k: v for k, v in sweep_params(hydra_cfg, overrides).items() if not k.lstrip("+~").startswith("hydra.")}
    if not params and not (multirun or str(OmegaConf.select(cfg, "hydra.mode", default="")).endswith("MULTIRUN")):
        return None
    parser = OverridesParser.create()
    dims: list[list[str]] = []
    for key, spec in params.items():
        override = parser.parse_override(f"{key}={spec}")
        if override.is_discrete_sweep():
            values = list(override.sweep_string_iterator())
        elif override.is_interval_sweep():
            interval = override.value()
            values = [str(interval.start), str(interval.end)]
        else:
            values = [str(spec)]
        dims.append([f"{key}={v}" for v in values])
    sampled = "optuna" in str(OmegaConf.select(cfg, "hydra.sweeper._target_", default="") or "").lower()
    if not sampled and math.prod(len(d) for d in dims) <= _MAX_PRODUCT:
        return [list(job) for job in itertools.product(*dims)]
    first = [d[0] for d in dims]
    return [first] + [[*first[:i], value, *first[i + 1:]] for i, d in enumerate(dims) for value in d[1:]]


def check_slurm_devices(devices: Any) -> None:
    """SLURM allocations are sized by ``trainer.devices``: it must be a positive count."""
    if isinstance(devices, int) and devices > 0:
        return
    raise UserError(
        f"trainer.devices={devices} cannot size a SLURM allocation (tasks_per_node and gpus_per_node come from it); "
        "set the GPUs per node, e.g. trainer.devices=4"
    )


# ------------------------------------------------------------------------- summary


def _runs(sweep_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(sweep_dir.rglob("run.json")):
        try:
            runs.append(json.loads(path.read_text()) | {"_dir": str(path.parent)})
        except (OSError, json.JSONDecodeError):
            continue
    return runs


def best_trial(sweep_dir: str | Path, metric: str, direction: str) -> dict[str, Any] | None:
    """The completed run under ``sweep_dir`` with the best ``metric``, or None if none completed."""
    done = [r for r in _runs(Path(sweep_dir)) if r.get("status") == "completed" and metric in r.get("metrics", {})]
    if not done:
        return None
    pick = min if direction == "minimize" else max
    return pick(done, key=lambda r: float(r["metrics"][metric]))


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_lines(sweep_dir: str | Path, metric: str, direction: str, storage: str | None = None) -> list[str]:
    """The closing lines of a sweep: best value and parameters, its run dir, how to resume."""
    sweep_dir = Path(sweep_dir)
    results_file = sweep_dir / "optimization_results.yaml"
    best_run = best_trial(sweep_dir, metric, direction)
    runs = _runs(sweep_dir)
    completed = sum(r.get("status") == "completed" for r in runs)
    if results_file.is_file():  # Optuna's answer (covers earlier sessions of a resumed study)
        results = OmegaConf.load(results_file)
        if "best_value" not in results:
            return [f"lightning-accel: multi-objective sweep finished; Pareto front in {results_file}"]
        best_value = float(results.best_value)
        params = {str(k): v for k, v in results.best_params.items()}
    elif best_run is not None:
        best_value = float(best_run["metrics"][metric])
        params = {}
    else:
        return [f"lightning-accel: sweep finished with no completed trial under {sweep_dir}; see the trials' run.json"]
    # The run whose own run.json holds the best value (it may belong to an earlier session).
    run_dir = best_run["_dir"] if best_run and math.isclose(float(best_run["metrics"][metric]), best_value, rel_tol=1e-6) else None
    lines = [
        f"lightning-accel: sweep finished: best {metric}={best_value:.6g} ({direction}) over {completed} completed trial(s) in {sweep_dir}",
        f"  params:  {' '.join(f'{k}={_fmt(v)}' for k, v in sorted(params.items())) or '(see the run config)'}",
        f"  run:     {run_dir or '(not under this sweep dir)'}",
    ]
    if results_file.is_file():
        lines.append(f"  results: {results_file}")
    if storage:
        lines.append(f"  study:   {storage} (resume: add hydra.sweep.dir={sweep_dir})")
    return lines


def resumed_session(sweep_dir: Path) -> int:
    """0 for a fresh sweep dir, else the number of the session about to resume it (1, 2, ...)."""
    previous = [p.parent.name for p in sweep_dir.glob("*/run.json")]
    if not previous:
        return 0
    sessions = [int(m.group(1)) for name in previous if (m := re.match(r"s(\d+)_\d+$", name))]
    return max(sessions, default=0) + 1


class SweepSummary(Callback):
    """Hydra callback: prepare the sweep directory, then print the best trial at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The Optuna study's SQLite file lives in the sweep dir, which Hydra's launchers
        # only create when the first trial launches -- after the study is opened.
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # Resuming (the dir already holds trials): Hydra numbers every session's jobs from
        # 0, so give this session's trial dirs a prefix instead of overwriting the earlier.
        session = resumed_session(sweep_dir)
        if session:
            # Each trial's config is recomposed from the hydra overrides: add ours there.
            with read_write(config.hydra.overrides):
                config.hydra.overrides.hydra.append(f"hydra.sweep.subdir=s{session}_${{hydra.job.num}}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        metric = str(config.get("optimized_metric") or "")
        if not metric:
            return
        direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
        if isinstance(direction, (list, ListConfig)) or direction is None:
            direction = metric_direction(metric)
        storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
        print("\n".join(summary_lines(str(config.hydra.sweep.dir), metric, str(direction), storage)), flush=True)
