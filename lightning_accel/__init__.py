"""lightning_accel: Lightning plugins and Hydra recipes for models too large, too deep or
too data-hungry for one accelerator.

Importing the package registers our strategy names with Lightning's StrategyRegistry
(idempotently), so ``Trainer(strategy="<name>")`` works after ``import lightning_accel``.
"""

from lightning_accel._registry import register_all as _register_all

__version__ = "0.1.0"

__all__ = ["__version__"]

_register_all()
