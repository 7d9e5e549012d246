"""L2L (layer-to-layer) CPU offload mechanism: blocks' weights live on the host and visit the device one at a time.

Plan, host store, streamer, executor, the host
optimizer step (fused CPU kernels, thread budget), and the optional one-step delayed update
and host-memory activation offload the executor uses. For data parallel: the host optimizer's
partition across ranks (``partition``), gradients averaged as blocks finish (``grad_sync``),
weights sent back from their owners (``weight_sync``) and the optimizer state's shards
(``optimizer_state``).

Nothing here imports Lightning; :class:`lightning_accel.strategies.L2LOffloadStrategy`
wires it into a Trainer.
"""

from lightning_accel.offload.executor import L2LExecutor
from lightning_accel.offload.plan import OffloadPlan, Unit, make_plan
from lightning_accel.offload.stats import OffloadStats

__all__ = ["L2LExecutor", "OffloadPlan", "OffloadStats", "Unit", "make_plan"]
