"""Small real model zoo used by recipes: GPT, ResNet-style CNN, MLP, and their Lightning tasks."""

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
