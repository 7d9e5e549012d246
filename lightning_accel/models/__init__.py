"""Small real model zoo used by recipes: GPT, ResNet-style CNN, MLP, and their Lightning tasks.

Builders for models this project did not write, ``hf_causal_lm`` (transformers) and
``litgpt_gpt`` (litgpt), are imported on first use (``from lightning_accel.models import
hf_causal_lm``): they need the hf extra, and a missing one is reported then, in one line.
"""

import importlib
from typing import Any

from lightning_accel.models.blocks import BlockNetwork
from lightning_accel.models.cnn import ResidualBlock, ResNet
from lightning_accel.models.gpt import GPT, GPT_PRESETS, GPTBlock
from lightning_accel.models.mlp import MLP, MLPBlock
from lightning_accel.models.tasks import ClassifierTask, LanguageModelTask

__all__ = [
    "GPT",
    "GPTBlock",
    "GPT_PRESETS",
    "ResNet",
    "ResidualBlock",
    "MLP",
    "MLPBlock",
    "LanguageModelTask",
    "ClassifierTask",
    "BlockNetwork",
]

_BUILDERS = {"hf_causal_lm": "lightning_accel.models.hf", "litgpt_gpt": "lightning_accel.models.litgpt_model"}


def __getattr__(name: str) -> Any:
    if name in _BUILDERS:
        return getattr(importlib.import_module(_BUILDERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
