"""Lightning's callbacks that touch every parameter, on a module split across a pipeline's ranks.

Under :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` each rank holds its own stages'
blocks and the others' as ``meta`` placeholders (:mod:`lightning_accel.pipeline.placeholders`), and each optimizer
holds only this rank's parameters. Lightning's built-in callbacks that walk every parameter are made to see real
tensors for what their rank holds and to leave the placeholders alone, each through patches on the callback object
itself (the user's: a later ``Trainer`` may get it), removed at teardown:

- ``ModelSummary``: runs ``example_input_array`` through the whole module on ``meta`` (every tensor swapped for a meta
  twin for that forward, then put back), so its in/out sizes and FLOPs are the whole model's, as under DDP; names,
  types and parameter counts as they are.
- ``BaseFinetuning``: unfreezing adds a param group of every parameter of a module, placeholders included; the strategy
  keeps this rank's (:meth:`~lightning_accel.pipeline.rank_split.RankSplit.follow_param_groups`), and the callback's
  record of the groups (what it restores on resume) is the whole model's, so a resume on any layout finds every one.
- ``StochasticWeightAveraging``: its averaged copy, made whole before the split, keeps on each rank only what the rank
  holds (the rest placeholders, which moving it to the device leaves as they are), averages those, resets only this
  rank's BatchNorm statistics, and its checkpoint state is the whole averaged model, gathered like the module's; after
  fit it is whole on every rank, as the module is (:func:`averaged_copies`).
- ``WeightAveraging`` (``EMAWeightAveraging``): the same for its ``AveragedModel``; the averaged weights it saves as a
  checkpoint's ``state_dict`` are the whole model's.
- ``ModelPruning``: refused before the first step. It reparametrizes every weight (``weight_orig`` and a mask), a
  global threshold over all of them, and which rank holds each tensor is decided by the split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning, ModelSummary, StochasticWeightAveraging, WeightAveraging
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_accel.patching import Patch, patch, swapped
from lightning_accel.pipeline.placement import RankLayout
from lightning_accel.pipeline.rank_split import RankSplit
from lightning_accel.pipeline.state_gather import gather_model_state

__all__ = ["adapt_callbacks", "averaged_copies", "refuse_callbacks"]


def refuse_callbacks(trainer: pl.Trainer, name: str) -> None:
    """Before any work: the callbacks a split module cannot honour, in one line each."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelPruning):
            raise ValueError(
                f"{name} cannot run ModelPruning (callbacks=[ModelPruning(...)]): it reparametrizes every weight, by a "
                "threshold over all of them, and each rank holds only its own stages; prune after fit, when every rank "
                "holds the whole module (torch.nn.utils.prune), or train with strategy='ddp'"
            )


def adapt_callbacks(
    trainer: pl.Trainer, module: pl.LightningModule, split: RankSplit, layout: RankLayout, global_rank: int,
) -> list[Patch]:
    """The patches that make this Trainer's callbacks work on the split ``module`` (see the module docstring), to
    remove at teardown."""
    patches: list[Patch] = []
    fitting = trainer.state.fn == TrainerFn.FITTING
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            patches.append(_summary_on_meta(callback))
        if isinstance(callback, WeightAveraging) and _copy_of(callback, module) is not None:  # validation swaps it in
            patches.append(_average_weights_this_rank_holds(callback, module, split, layout, global_rank))
        if not fitting:  # the callbacks below act during fit only
            continue
        if isinstance(callback, BaseFinetuning):
            patches.append(_whole_groups_stored(callback, trainer, split, layout))
        if isinstance(callback, StochasticWeightAveraging) and _copy_of(callback, module) is not None:
            patches += _average_what_this_rank_holds(callback, module, split, layout, global_rank)
    return patches


def _copy_of(callback: pl.Callback, module: nn.Module) -> nn.Module | None:
    """The copy of ``module`` a weight-averaging callback keeps (SWA's averaged LightningModule, the module inside
    WeightAveraging's ``AveragedModel``), if it has the module's structure (one made before ``configure_model`` built
    the network has not: as under DDP, it averages nothing of it)."""
    copy = None
    if isinstance(callback, StochasticWeightAveraging):
        copy = callback._average_model
    elif isinstance(callback, WeightAveraging) and callback._average_model is not None:
        copy = callback._average_model.module
    return copy if copy is not None and copy.state_dict().keys() == module.state_dict().keys() else None


def averaged_copies(trainer: pl.Trainer, module: nn.Module) -> list[nn.Module]:
    """The module copies this Trainer's callbacks keep, freed like the module (SWA's and WeightAveraging's averaged
    models): made whole with it after fit, so what the callback saves or copies back is the whole model's there too."""
    copies = [_copy_of(c, module) for c in trainer.callbacks]  # type: ignore[attr-defined]
    return [c for c in copies if c is not None]


def _whole_copy_state(
    state: dict[str, Any], prefix: str, module: nn.Module, split: RankSplit, layout: RankLayout, global_rank: int,
) -> dict[str, Any]:
    """A copy's state dict (its names: ``prefix`` + the module's) as the whole model's, gathered on rank 0 like the
    module's (a collective, as saving a checkpoint is): what is outside the blocks from a rank that steps it; entries
    not under ``prefix`` (the averaging's counter) as they are."""
    live = module.state_dict(keep_vars=True)

    def held(name: str, t: Tensor) -> Tensor:
        own = name[len(prefix):] if name.startswith(prefix) else None
        return t if own not in live or split.counted_here(live[own], layout) else t.to("meta")

    return gather_model_state({n: held(n, t) for n, t in state.items()}, layout, global_rank)


class _ExampleOnMeta(Summary):
    """Lightning's summary with its example forward on ``meta``: the module's tensors (this rank's stages, the others'
    placeholders) and the example input, once the user's batch-transfer hooks have run on it, swapped for ``meta``
    twins for the forward, so the in/out sizes and the FLOPs (counted from shapes) are the whole model's, as under
    DDP, and nothing is computed; every tensor is put back after."""

    def _forward_example_input(self) -> None:
        model = self._model
        real = model.example_input_array
        ready = model._apply_batch_transfer_handler(model._on_before_batch_transfer(real))
        model.example_input_array = apply_to_collection(ready, Tensor, lambda t: t.to("meta"))  # a property: not swapped()
        saved = [(table, k, t) for m in model.modules() for table in (m._parameters, m._buffers)
                 for k, t in table.items() if t is not None and not t.is_meta]
        for table, k, t in saved:
            table[k] = nn.Parameter(t.to("meta"), t.requires_grad) if isinstance(t, nn.Parameter) else t.to("meta")
        try:
            with swapped(model, "_on_before_batch_transfer", lambda b, *_: b), swapped(model, "_apply_batch_transfer_handler", lambda b, *_: b):
                super()._forward_example_input()
        finally:
            for table, k, t in saved:
                table[k] = t
            model.example_input_array = real


def _summary_on_meta(callback: ModelSummary) -> Patch:
    """Lightning's model summary, at fit start on every rank, runs ``example_input_array`` through the whole module to
    show layer sizes and FLOPs; on a split module that forward would reach the placeholders, so it runs on meta."""
    summary = callback._summary

    def on_meta(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
        example = module.example_input_array
        if example is None:
            return summary(trainer, module)
        try:
            return _ExampleOnMeta(module, max_depth=callback._max_depth)
        except Exception as err:  # noqa: BLE001  # a kernel that refuses meta tensors: the summary without sizes
            rank_zero_warn(
                f"ModelSummary: example_input_array could not run on the meta device ({type(err).__name__}: "
                f"{(str(err).splitlines() or [''])[0][:200]}), so the summary leaves out in/out sizes and FLOPs"
            )
        module.example_input_array = None  # a property: not swapped()
        try:
            return summary(trainer, module)
        finally:
            module.example_input_array = example

    return patch(callback, "_summary", on_meta)


def _whole_groups_stored(callback: BaseFinetuning, trainer: pl.Trainer, split: RankSplit, layout: RankLayout) -> Patch:
    """``BaseFinetuning`` records each optimizer's param groups by parameter name after its ``finetune_function`` (and
    restores them by name on resume): it records the whole model's groups, not this rank's share."""
    store = callback._store

    def whole(pl_module: pl.LightningModule, opt_idx: int, num_param_groups: int, current: list[dict[str, Any]]) -> None:
        split.follow_param_groups(trainer.optimizers, layout)
        store(pl_module, opt_idx, num_param_groups, split.whole_param_groups(opt_idx, trainer.optimizers[opt_idx]))

    return patch(callback, "_store", whole)


def _average_what_this_rank_holds(
    callback: StochasticWeightAveraging, module: pl.LightningModule, split: RankSplit, layout: RankLayout, global_rank: int,
) -> list[Patch]:
    average = callback._average_model
    assert average is not None
    _placeholders_like(average, module)
    apply = average._apply

    def keep_placeholders(fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        return apply(lambda t: t if t.is_meta else fn(t), recurse)  # .to(device) leaves placeholders where they are

    reset = callback.reset_batch_norm_and_save_state

    def reset_held(pl_module: pl.LightningModule) -> None:
        freed = [m for m in pl_module.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None and m.running_mean.is_meta]
        reset(pl_module)  # new zeros/ones statistics for every BatchNorm, on the device: only this rank's keep them
        for bn in freed:
            bn.running_mean = torch.empty_like(bn.running_mean, device="meta")
            bn.running_var = torch.empty_like(bn.running_var, device="meta")

    state_dict = callback.state_dict

    def whole_state() -> dict[str, Any]:
        state = state_dict()
        if state.get("average_model_state") is not None:
            state["average_model_state"] = _whole_copy_state(state["average_model_state"], "", module, split, layout, global_rank)
        return state

    return [
        patch(average, "_apply", keep_placeholders),
        patch(callback, "reset_batch_norm_and_save_state", reset_held),
        patch(callback, "state_dict", whole_state),
    ]


def _average_weights_this_rank_holds(
    callback: WeightAveraging, module: pl.LightningModule, split: RankSplit, layout: RankLayout, global_rank: int,
) -> Patch:
    """``WeightAveraging`` (``EMAWeightAveraging``): its ``AveragedModel``, made whole in its setup hook (or after the last
    run), keeps only what this rank holds (its updates, the swaps around validation and its copy back then pair
    placeholder with placeholder), and the state it puts in a checkpoint (the averaged weights as the checkpoint's
    ``state_dict``) is the whole model's."""
    averaged = callback._average_model
    assert averaged is not None
    _placeholders_like(averaged.module, module)
    state_dict = averaged.state_dict

    def whole_state(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return _whole_copy_state(state_dict(*args, **kwargs), "module.", module, split, layout, global_rank)

    return patch(averaged, "state_dict", whole_state)


def _placeholders_like(copy: nn.Module, module: nn.Module) -> None:
    """Free in ``copy`` (the same structure) every tensor that is a placeholder in ``module``."""
    for original, copied in zip(module.modules(), copy.modules()):
        for name, t in original._parameters.items():
            p = copied._parameters.get(name)
            if t is not None and t.is_meta and p is not None:
                copied._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        for name, t in original._buffers.items():
            b = copied._buffers.get(name)
            if t is not None and t.is_meta and b is not None:
                copied._buffers[name] = b.to("meta")
