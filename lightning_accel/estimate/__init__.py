"""Will this recipe fit, and where does the memory go: ``lightning-accel estimate``.

A recipe's network is built on the meta device, its training step runs once on fake tensors
(activations and optimizer state measured, nothing allocated), and each strategy's own rules
add up every rank's device and host bytes by component:

- :mod:`.live_bytes`: bytes alive under a dispatch mode;
- :mod:`.fake`: a meta-built model as fake CPU tensors in the dtypes a strategy keeps;
- :mod:`.batch`: one batch of a data module as fake tensors;
- :mod:`.activations`: a step's activations, per block and at peak;
- :mod:`.params`: the model's tensors by unit, stored bytes (NF4) and optimizer state;
- :mod:`.components`: the arithmetic per strategy;
- :mod:`.tier`: the NVMe tier's plan (``host_budget`` / ``nvme_path``), the strategy's own;
- :mod:`.report`: table, verdict and JSON;
- :mod:`.recipe`: from a recipe to an estimate;
- :mod:`.regenerate`: the figures README.md and the recipes quote, written from the estimate;
- :mod:`.measure`: ``--measure``: a real run's ``torch.cuda.max_memory_allocated`` beside each device's figure.
"""

from lightning_accel.estimate.components import Plan, RankEstimate, estimate_ranks
from lightning_accel.estimate.recipe import estimate_recipe
from lightning_accel.estimate.report import Estimate, parse_size

__all__ = ["Estimate", "Plan", "RankEstimate", "estimate_ranks", "estimate_recipe", "parse_size"]
