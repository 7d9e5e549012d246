"""DistributedGPipeStrategy on models this project did not write (transformers Llama, GPT-2, Qwen2, Mistral; litgpt GPT),
on 2 gloo ranks launched by Lightning, against plain single-process Lightning: float64, the same seeded start and data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

PIPELINE_TESTS = Path(__file__).resolve().parents[1] / "pipeline"
sys.path.insert(0, str(PIPELINE_TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_models import assert_same_weights, fit  # noqa: E402
from real_models_worker import STEPS, task  # noqa: E402
from user_script import run_user_script  # noqa: E402

# GPT-2 without dropout: micro-batches draw other dropout masks than one whole batch does
CASES = [
    ("llama", "gpipe"), ("llama", "1f1b"), ("gpt2-no-dropout", "gpipe"), ("gpt2-no-dropout", "1f1b"),
    ("litgpt", "gpipe"), ("litgpt", "1f1b"), ("qwen2", "gpipe"), ("mistral", "1f1b"),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_models")
    cases = ",".join(f"{m}:{s}" for m, s in CASES)
    result = run_user_script(PIPELINE_TESTS / "real_models_worker.py", [str(out), cases], 300, "2-process real models")
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def _loaded(name: str, checkpoint: Path) -> torch.nn.Module:
    """The gathered checkpoint in a plain model: every name of the user's model, nothing else (strict)."""
    plain = task(name)
    plain.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"], strict=True)
    return plain


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_real_models_train_like_plain_lightning(two_ranks, name, schedule):
    reference = task(name)
    fit(reference, steps=STEPS, precision="64-true")
    assert_same_weights(reference, _loaded(name, two_ranks / f"{name}-{schedule}.ckpt"), rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_resuming_a_real_model_from_the_gathered_checkpoint_is_exact(two_ranks, tmp_path):
    """Llama: 2 steps, saved; resumed in a fresh Trainer to step 4 equals plain Lightning resuming the same checkpoint
    (the checkpoint ends mid-epoch, so both replay the loader alike), and the 2-step checkpoint equals plain's 2 steps."""
    half = task("llama")
    fit(half, steps=STEPS // 2, precision="64-true")
    assert_same_weights(half, _loaded("llama", two_ranks / "llama-gpipe-half.ckpt"), rtol=1e-9, atol=1e-11)
    plain = task("llama")
    fit(plain, steps=STEPS, precision="64-true", ckpt_path=two_ranks / "llama-gpipe-half.ckpt")
    assert_same_weights(plain, _loaded("llama", two_ranks / "llama-gpipe-resumed.ckpt"), rtol=1e-9, atol=1e-11)
