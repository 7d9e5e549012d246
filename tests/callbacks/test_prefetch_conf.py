"""conf/callbacks/prefetch.yaml composes onto a recipe and builds the three prefetch callbacks."""

from __future__ import annotations

from hydra.utils import instantiate

from lightning_accel.callbacks import DataWaitMonitor, DevicePrefetcher, PrefetchTuner
from lightning_accel.config.compose import compose_recipe


def test_prefetch_callbacks_group_builds_the_callbacks_in_order():
    cfg = compose_recipe("resnet-tiny_cpu", ["callbacks=prefetch"])
    assert list(cfg.callbacks) == ["model_checkpoint", "data_wait_monitor", "prefetch_tuner", "device_prefetcher"]
    tuner = instantiate(cfg.callbacks.prefetch_tuner)
    assert isinstance(tuner, PrefetchTuner) and tuner.options.cache_path.endswith("prefetch_tuned.json")
    assert isinstance(instantiate(cfg.callbacks.data_wait_monitor), DataWaitMonitor)
    assert isinstance(instantiate(cfg.callbacks.device_prefetcher), DevicePrefetcher)
