"""Precision for L2L offload: low-precision device copies over fp32 host masters.

Under :class:`~lightning_accel.strategies.L2LOffloadStrategy` the weights cross the bus
every step, so their device copies are made in the compute precision (bf16/fp16: half
the bytes of fp32) while the host keeps fp32 masters and the optimizer steps those.
Forward runs under autocast like Lightning's ``MixedPrecision``; ``"16-mixed"`` scales
the loss and skips the step when a gradient overflows (``torch.amp.GradScaler``, which
handles the host gradients and the device ones alike).

:func:`for_offload` is how the L2L strategies take ``Trainer(precision="bf16-mixed")``: Lightning
hands them its ``MixedPrecision``, and they run the ``OffloadPrecision`` of the same flag instead.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

OffloadPrecisionFlag = Literal["bf16-mixed", "16-mixed", "32-true"]
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
# Lightning's precision flags an L2L strategy runs under, as a user may write them, and the
# OffloadPrecision each becomes (None: fp32, run as given). Every other flag would change the host
# masters' dtype and is refused, at set-up (for_offload) and before it (config.setup_checks).
OFFLOAD_PAIRS: dict[str, str | None] = {"32-true": None, "32": None, "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
                                        "16-mixed": "16-mixed", "16": "16-mixed"}
KEEPS_FP32_MASTERS = "keeps fp32 masters on the host and makes only the device copies low precision"


class OffloadPrecision(MixedPrecision):
    """``OffloadPrecision("bf16-mixed" | "16-mixed" | "32-true")`` for ``L2LOffloadStrategy``.

    ``device`` is the autocast device type; the strategy sets it from its root device when
    left as None. ``init_scale`` is the fp16 loss scale to start from (halved on every
    overflow, when the step is skipped; grown again after 2000 clean steps).
    """

    def __init__(self, precision: OffloadPrecisionFlag = "bf16-mixed", device: str | None = None, init_scale: float = 2.0**16) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"OffloadPrecision does not support precision={precision!r}; choose one of "
                f"{', '.join(_DTYPES)} (fp32 masters on the host, copies in that precision on the device)"
            )
        self.init_scale = init_scale
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # the strategy may still change it
        scaler = torch.amp.GradScaler(device, init_scale=init_scale) if precision == "16-mixed" else None
        if precision == "32-true":
            # MixedPrecision only takes the mixed flags; set its fields directly.
            self.precision = "32-true"  # type: ignore[assignment]
            self.device = device
            self.scaler = None
        else:
            super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.compute_dtype: torch.dtype = _DTYPES[precision]

    def set_device(self, device_type: str) -> None:
        """Point autocast (and the fp16 scaler) at the strategy's device type."""
        self.device = device_type
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=self.init_scale)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with nullcontext() if self.precision == "32-true" else self.autocast_context_manager():
            yield

    @override
    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"OffloadPrecision({self.precision!r})"


def for_offload(plugin: Precision | None, strategy_name: str) -> Precision | None:
    """The precision plugin an L2L strategy runs under, given the one Lightning hands it.

    ``OffloadPrecision`` and fp32 (``Precision``, Lightning's ``"32-true"``) run as given;
    Lightning's own ``MixedPrecision("bf16-mixed" | "16-mixed")`` becomes the ``OffloadPrecision``
    of the same flag (same autocast device; for fp16 a ``torch.amp.GradScaler`` from the same
    initial scale), since the host keeps fp32 masters and only the device copies can be low
    precision. Anything else (``"bf16-true"``, ``"64-true"``, a quantizing plugin) would change
    the masters' dtype, which offload cannot honour: a ``ValueError`` naming it and the fix.
    """
    if plugin is None or isinstance(plugin, OffloadPrecision) or type(plugin) is Precision:
        return plugin
    flag = getattr(plugin, "precision", None)
    scaler = getattr(plugin, "scaler", None)
    if type(plugin) is MixedPrecision and OFFLOAD_PAIRS.get(flag) is not None:
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"precision={flag!r} with a {type(scaler).__name__} loss scaler: strategy={strategy_name!r} scales "
                f"with torch.amp.GradScaler only; pass plugins=[OffloadPrecision({flag!r}, init_scale=...)]"
            )
        # a GradScaler keeps the scale it was built with in _init_scale until its first step
        init_scale = float(getattr(scaler, "_init_scale", 2.0**16)) if scaler is not None else 2.0**16
        return OffloadPrecision(flag, device=plugin.device, init_scale=init_scale)
    raise refused_precision(flag, type(plugin).__name__, strategy_name)


def refused_precision(flag: object, plugin_name: str, strategy_name: str) -> ValueError:
    """The one line that refuses a precision an L2L strategy cannot honour (either front door: Trainer or Fabric)."""
    named = f"precision={flag!r}" if isinstance(flag, str) else "the precision plugin"
    return ValueError(
        f"{named} ({plugin_name}): strategy={strategy_name!r} {KEEPS_FP32_MASTERS}; "
        f"use precision='bf16-mixed', '16-mixed' or '32-true' "
        f"(or plugins=[OffloadPrecision('bf16-mixed')])"
    )
