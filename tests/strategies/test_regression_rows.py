"""The regression rows of docs/models.md under ``l2l_offload`` and ``gpipe`` (2 CPU stages, chunks 2): BERT, GPT-NeoX,
Gemma 3, Mamba, ViT, and a Llama with frozen layers, peft LoRA, its own gradient checkpointing or compiled layers train
to plain Lightning's weights (3 AdamW steps, float64; :mod:`regression_models`). ``gpipe_distributed``'s row is in
``test_gpipe_distributed_real_models.py`` (the same reference, in the existing 2-rank launch)."""

from __future__ import annotations

import warnings

import pytest

from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

pytest.importorskip("transformers")
from tests.support.regression_models import ROWS, fit, max_difference, reference, task, tolerance  # noqa: E402


def _trained(name: str, strategy: object) -> dict:
    module = task(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off for the fit, said once: test_real_models checks that
        fit(module, name, strategy)
    return module.state_dict()


@pytest.mark.parametrize("name", ROWS)
def test_l2l_offload_trains_the_row_like_plain_lightning(name: str) -> None:
    assert max_difference(name, _trained(name, L2LOffloadStrategy())) <= tolerance(name)


@pytest.mark.parametrize("name", ROWS)
def test_gpipe_trains_the_row_like_plain_lightning(name: str) -> None:
    assert max_difference(name, _trained(name, GPipeStrategy(devices=2, chunks=2))) <= tolerance(name)


def test_the_reference_moves_the_weights_far_beyond_the_tolerance() -> None:
    """A strategy that skipped a step or a block's gradient would land ~1e-2 away: the comparisons can fail."""
    for name in ROWS:
        initial = {k: v for k, v in task(name).state_dict().items()}
        trained = reference(name)
        assert max(float((trained[k] - initial[k]).abs().max()) for k in initial if initial[k].is_floating_point()) > 1e-2
