"""What loading a pretrained checkpoint cost the host: its peak added memory against the weights' stored size.

A 7B model in bf16 is 15 GB; a loader that builds it in fp32 first, or reads every shard
into memory before assigning it, needs twice that or more at its peak, and the run dies
before the first step on a host that holds the model itself comfortably. transformers 5
loads a bf16 safetensors directory into a bf16 model without an fp32 copy (the tensors
map the file); :class:`LoadPeak` is the measurement that says so for the user's own
directory: ``hf_causal_lm`` records it on the model it loads (:func:`record`), and the
run prints it (:func:`describe`) beside the plan, as a ratio a user can check against
their host before a 70B load.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_accel.stored import stored_nbytes

_ATTRIBUTE = "_lightning_accel_load_peak"


@dataclass(frozen=True)
class LoadPeak:
    """``added``: the most host memory the load added (None: not measurable here); ``stored``: the loaded model's
    parameters and buffers as stored (bytes)."""

    path: str
    added: int | None
    stored: int

    def describe(self) -> str:
        size = f"their stored {self.stored / 2**30:.3f} GiB"
        if self.added is None:
            return f"pretrained weights from {self.path}: {size} (peak host memory at load not measurable here)"
        return (f"pretrained weights from {self.path} loaded at a peak of +{self.added / 2**30:.3f} GiB host memory, "
                f"{self.added / max(self.stored, 1):.2f}x {size}")


def model_bytes(model: nn.Module) -> int:
    """``model``'s parameters and buffers as stored (a tied tensor once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(stored_nbytes(t) for t in tensors.values())


def record(model: nn.Module, path: str, added: int | None) -> LoadPeak:
    """Measure ``model`` as loaded and keep the record on it, where :func:`find` looks."""
    peak = LoadPeak(path, added, model_bytes(model))
    setattr(model, _ATTRIBUTE, peak)
    return peak


def find(module: nn.Module) -> LoadPeak | None:
    """The record of the pretrained model inside ``module`` (a task, a peft wrapper), if one was loaded."""
    for sub in module.modules():
        peak = getattr(sub, _ATTRIBUTE, None)
        if isinstance(peak, LoadPeak):
            return peak
    return None
