"""Python API misuse of the four strategies: a one-line ``ValueError`` / ``TypeError`` naming the argument, the value
and the fix, from the constructor (or, for ``device=`` against the accelerator, from ``Trainer(...)``), before any step."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_accel import DistributedGPipeStrategy, GPipeStrategy, L2LOffloadDDPStrategy, L2LOffloadStrategy
from lightning_accel.strategies.options_check import OptionValueError

# (what, constructor, error type, the line's pattern): one or more examples of each kind of argument
MISUSE: list[tuple[str, Callable[[], Any], type, str]] = [
    # counts
    ("prefetch as str", lambda: L2LOffloadStrategy(prefetch_blocks="2"), TypeError,
     r"^L2LOffloadStrategy: prefetch_blocks takes an int >= 0 .*got the str '2'; pass prefetch_blocks=2$"),
    ("prefetch as float", lambda: L2LOffloadDDPStrategy(prefetch_blocks=1.5), TypeError,
     r"^L2LOffloadDDPStrategy: prefetch_blocks takes an int >= 0 .*got the float 1.5; pass an int, e.g. prefetch_blocks=1$"),
    ("prefetch as bool", lambda: L2LOffloadStrategy(prefetch_blocks=True), TypeError, r"got the bool True"),
    ("warmup below 0", lambda: L2LOffloadStrategy(delayed_update=True, delayed_update_warmup=-3), ValueError,
     r"^L2LOffloadStrategy: delayed_update_warmup must be >= 0, got -3 .*; pass e.g. delayed_update_warmup=10$"),
    # flags: a truthy string is not taken for True
    ("flag as str", lambda: L2LOffloadStrategy(checkpoint_blocks="false"), TypeError,
     r"^L2LOffloadStrategy: checkpoint_blocks takes True or False, got the str 'false'; pass checkpoint_blocks=False$"),
    ("flag as int", lambda: L2LOffloadDDPStrategy(offload_activations=1), TypeError, r"offload_activations takes True or False.*pass offload_activations=True$"),
    ("flag on a pipeline", lambda: GPipeStrategy(devices=["cpu"], deferred_batch_norm="yes"), TypeError,
     r"^GPipeStrategy: deferred_batch_norm takes True or False or None, got the str 'yes'; pass deferred_batch_norm=True$"),
    ("optional flag", lambda: L2LOffloadStrategy(overlap_step="no"), TypeError, r"overlap_step takes True or False or None"),
    ("deferred_init as another str", lambda: DistributedGPipeStrategy(deferred_init="false"), TypeError,
     r"^DistributedGPipeStrategy: deferred_init takes True, False or 'parts', got the str 'false'; pass deferred_init=True, "
     r"deferred_init=False or deferred_init='parts'$"),
    # timeouts
    ("negative timeout", lambda: DistributedGPipeStrategy(timeout=-5), ValueError,
     r"^DistributedGPipeStrategy: timeout must be a finite number of seconds > 0 .*got -5; pass timeout=1800"),
    ("zero timedelta", lambda: L2LOffloadDDPStrategy(timeout=timedelta(0)), ValueError, r"timeout must be a finite number of seconds > 0"),
    ("timeout as str", lambda: DistributedGPipeStrategy(timeout="soon"), TypeError, r"timeout takes seconds \(a number > 0\) or a timedelta, got the str 'soon'"),
    # block policies
    ("blocks as int", lambda: L2LOffloadStrategy(blocks=42), TypeError,
     r"^L2LOffloadStrategy: blocks takes 'auto', block classes \(or their names\) or a callable, got the int 42; pass e.g. blocks=\['GPTBlock'\]"),
    ("a function in blocks", lambda: GPipeStrategy(devices=["cpu"], blocks=[torch.nn.functional.relu]), TypeError,
     r"^GPipeStrategy: blocks lists torch.nn.functional.relu, a function, where each entry is a block's nn.Module class"),
    ("a non-module class in blocks", lambda: DistributedGPipeStrategy(blocks=[torch.optim.AdamW]), TypeError,
     r"blocks lists torch.optim.adamw.AdamW, the type .*nn.Module class"),
    ("no blocks", lambda: L2LOffloadStrategy(blocks=[]), ValueError, r"blocks lists no block class"),
    # stages against devices
    ("balance shorter than devices", lambda: GPipeStrategy(devices=["cpu"] * 3, balance=[2, 2]), ValueError,
     r"^GPipeStrategy: balance \[2, 2\] has 2 stages but devices=\['cpu', 'cpu', 'cpu'\] gives 3 \(1 device\(s\) idle\); list one device per stage"),
    ("balance against a device count", lambda: GPipeStrategy(devices=4, balance=[1, 1, 2]), ValueError, r"has 3 stages but devices=4 gives 4"),
    # devices
    ("unknown device", lambda: L2LOffloadStrategy(device="gpu0"), ValueError,
     r"^L2LOffloadStrategy: device='gpu0' is not a device torch knows; pass e.g. device='cuda:0'"),
    ("device as float", lambda: L2LOffloadStrategy(device=0.5), TypeError, r"device takes a device, got the float 0.5"),
]


@pytest.mark.parametrize(("build", "kind", "pattern"), [c[1:] for c in MISUSE], ids=[c[0] for c in MISUSE])
def test_misuse_is_one_line_naming_the_argument_the_value_and_the_fix(build: Callable[[], Any], kind: type, pattern: str) -> None:
    with pytest.raises(kind, match=pattern) as raised:
        build()
    assert "\n" not in str(raised.value)


def test_right_arguments_still_build() -> None:
    """The checks refuse only what is wrong: every kind's accepted forms build (a test that refused everything would
    pass the misuse cases above)."""
    L2LOffloadStrategy(blocks=["GPTBlock"], prefetch_blocks=0, checkpoint_blocks=False, overlap_step=None, device="cpu")
    L2LOffloadStrategy(blocks=nn.Linear, delayed_update=True, delayed_update_warmup=0, device=torch.device("cpu"))
    L2LOffloadStrategy(blocks=lambda model: list(model.children()))  # a callable policy: asked at set-up
    L2LOffloadDDPStrategy(timeout=timedelta(seconds=30), offload_activations=True)
    DistributedGPipeStrategy(timeout=60, blocks="transformers.models.llama.modeling_llama.LlamaDecoderLayer", balance=[2, 2])
    DistributedGPipeStrategy(deferred_init="parts"), DistributedGPipeStrategy(deferred_init=False)
    GPipeStrategy(devices=["cpu", "cpu"], balance=[1, 3], deferred_batch_norm=True)


def test_a_device_of_another_accelerator_is_refused_when_the_trainer_is_built() -> None:
    """``L2LOffloadStrategy(device='cuda:0')`` on a CPU Trainer: refused by ``Trainer(...)``, not by Lightning's
    accelerator code at the first set-up step."""
    with pytest.raises(OptionValueError, match=r"^L2LOffloadStrategy: device='cuda:0' computes on cuda, but the Trainer's "
                                                r"accelerator is cpu; drop device= .*accelerator='gpu'$"):
        Trainer(strategy=L2LOffloadStrategy(device="cuda:0"), accelerator="cpu", logger=False, enable_checkpointing=False)
    Trainer(strategy=L2LOffloadStrategy(device="cpu"), accelerator="cpu", logger=False, enable_checkpointing=False)
