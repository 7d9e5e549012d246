"""What our commands print: our lines and the warnings that matter, without Lightning's tips or libraries' probe lines.

``lightning-accel run`` and ``lightning-accel bench`` enter :func:`quiet` for their length.
Inside it:

- Lightning's product tips ("💡 Tip: ... litlogger", "... litmodels") are dropped, at the
  handlers that would print them (Lightning's own stderr handler; under ``run``, Hydra's
  console and log-file handlers, see :func:`lightning_accel.runner.route_output`).
- Python warnings that third-party code raises inside itself and a user can do nothing
  about (:data:`KNOWN_WARNINGS`: Lightning 2.6's pytree deprecation on torch 2.13) are
  ignored; every other warning shows, Lightning's included.
- PyTorch's profiler library (kineto) prints "USDT: ... profiler_start" and
  "profiler_stop" to stderr each time a profiler starts and stops (``bench pipeline``'s
  memory table measures with one; a recipe may set ``trainer.profiler``). Those lines are
  written at kineto's highest level, so the only level that drops them is the one above
  all: ``KINETO_LOG_LEVEL=6``, set here unless the environment already sets it (set it
  yourself, e.g. to 2, to see kineto's own messages again). Kineto reads it once, when a
  process starts its first profiler; ranks that our command starts inherit it.
- ``bench`` only: Lightning's info lines ("GPU available: ...", "`Trainer.fit` stopped:
  ...") are dropped too; a bench runs many short fits, and its closing line names the
  machine. The bench's own trainers define a ``validation_step`` and train without a
  validation loader on purpose, so Lightning's warning about that is dropped as well.
  Our own info lines (a strategy's plan) and every warning stay.

Leaving :func:`quiet` puts the handlers, the warning filters and the environment back, so
a command called in-process (tests, notebooks) leaves the caller's set-up as it found it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["KNOWN_WARNINGS", "DropNoise", "quiet"]

TIPS = ("💡 Tip:",)
# Deprecation warnings raised inside third-party code (Lightning 2.6 on torch 2.13) that a user can do nothing about.
KNOWN_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)`? is deprecated",
    r".*'set_vital' is deprecated",
)
# What the benches' own trainers make Lightning say, which says nothing about the user's set-up.
BENCH_WARNINGS = (r"You defined a `validation_step` but have no `val_dataloader`",)
KINETO_LOG_LEVEL = "6"  # above kineto's USDT level (5): its probe markers are not printed
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")

_LIGHTNING_DIRS: tuple[str, ...] | None = None


def _lightning_dirs() -> tuple[str, ...]:
    """Where Lightning's code lives: a record logged from there is Lightning's own, not ours."""
    global _LIGHTNING_DIRS
    if _LIGHTNING_DIRS is None:
        found = (importlib.util.find_spec(name) for name in ("lightning", "lightning_fabric", "pytorch_lightning"))
        _LIGHTNING_DIRS = tuple(
            os.path.dirname(spec.origin) + os.sep for spec in found if spec is not None and spec.origin is not None
        )
    return _LIGHTNING_DIRS


class DropNoise(logging.Filter):
    """Drops Lightning's tips; with ``lightning_info=False`` also the info lines Lightning logs from its own code."""

    def __init__(self, lightning_info: bool = True) -> None:
        super().__init__()
        self.lightning_info = lightning_info

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.getMessage()).lstrip().startswith(TIPS):
            return False
        if not self.lightning_info and record.levelno < logging.WARNING:
            # rank_zero_info's stacklevel names its caller: Lightning's trainer, or our strategy
            return not record.pathname.startswith(_lightning_dirs())
        return True


@contextmanager
def quiet(bench: bool) -> Iterator[None]:
    """For the length of one of our commands: no tips, no kineto probe lines, no known third-party deprecations
    (and, in a bench, none of Lightning's info lines); see the module docstring."""
    import lightning.pytorch  # noqa: F401  (installs Lightning's stderr handler, which the filter goes on)

    noise = DropNoise(lightning_info=not bench)
    handlers = [h for name in ("", *LIGHTNING_LOGGERS) for h in logging.getLogger(name).handlers]
    for handler in handlers:
        handler.addFilter(noise)
    kineto_was = os.environ.get("KINETO_LOG_LEVEL")
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_LOG_LEVEL)
    try:
        with warnings.catch_warnings():
            for pattern in KNOWN_WARNINGS + (BENCH_WARNINGS if bench else ()):
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(noise)
        if kineto_was is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
