"""A conformance suite of Lightning's API under our strategies: each feature a user's Lightning code relies on, run
under each strategy and under the Lightning strategy it stands in for, in float64 on a tiny model.

Why this shape: a feature costs a fraction of a second, a process start (and a 2-rank launch) seconds. So one process
(or one pair of ranks) per strategy runs every feature in turn (:mod:`tests.support.workers.conformance_worker`), each
feature saving what it saw (:mod:`.run`); the tests read those results, one test per (feature, strategy).

The features, by Lightning 2.6's API: :mod:`.features_logging` (self.log and its options, torchmetrics, all_gather,
epoch-end outputs, the sanity check, several dataloaders), :mod:`.features_optimization` (hooks' gradients, manual
optimization, toggle_optimizer, clipping, accumulation, schedulers, overridden optimizer_step / zero_grad),
:mod:`.features_callbacks` (the built-in callbacks), :mod:`.features_checkpoint` (loggers, checkpoint hooks and contents,
resume, the module after fit), :mod:`.features_loop` (hook order, predict/test/validate, data modules,
configure_model, detect_anomaly, on_exception), :mod:`.features_model_calls` (the model called otherwise than once per
training step) and :mod:`.features_ranks` (what counts replicas).
"""

from __future__ import annotations

from collections.abc import Callable

from tests.support.conformance import (
    features_callbacks,
    features_checkpoint,
    features_logging,
    features_loop,
    features_model_calls,
    features_optimization,
    features_ranks,
)
from tests.support.conformance.run import STRATEGIES, UNDER_TEST, Run, Strategy

FEATURES: dict[str, Callable[[Run], None]] = {
    **features_logging.FEATURES, **features_optimization.FEATURES, **features_callbacks.FEATURES,
    **features_checkpoint.FEATURES, **features_loop.FEATURES, **features_model_calls.FEATURES, **features_ranks.FEATURES,
}

__all__ = ["FEATURES", "STRATEGIES", "UNDER_TEST", "Run", "Strategy"]
