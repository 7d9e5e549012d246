"""Materializing a model built on the ``meta`` device, only the part a rank keeps, with initial weights that do not depend on the layout.

Why: a model built in full on every rank (to be split into stages afterwards) must fit in
one host's memory. Built on ``meta`` instead (shapes and dtypes, no storage), each rank
gives storage only to the tensors it keeps (its stages' blocks and what is outside the
blocks) and initializes them there; the other stages' blocks stay on ``meta``.

How the initial weights are made: :func:`materialize` gives each kept tensor fresh storage
(a tied tensor stays one tensor), then initializes module by module with the model's own
code: the nearest enclosing module's per-module initializer ``_init_weights(module)``
(transformers' ``PreTrainedModel``, litgpt's ``GPT``, the zoo GPT), children before parents as
transformers applies it; a module whose tensors that leaves unset gets its own
``reset_parameters()`` (torch layers, litgpt's rotary cache) and then the initializer again,
so the model's choice wins where it makes one. Each call runs under the CPU random
generator seeded from ``(seed, the module's qualified name)``, so a module's values depend
on nothing else: not on which rank initializes it, which other modules exist there, or in
which order.

What equality holds: the tensors a rank materializes equal the same tensors of
``materialize(module, seed)`` run on the whole model in one process (any layout, any number
of ranks), as long as a module's initializer touches only its own subtree and a module
that contains blocks touches no tensor inside them (true of transformers, litgpt and the
zoo models). They do not equal plain construction (``Model(config)`` draws every tensor
from one random stream in construction order), and they follow the model's own
distributions, not torch's layer defaults, where the model has an initializer.

Where the whole model fits in memory, the strategy gives each rank the values of the user's own build instead
(:mod:`lightning_accel.pipeline.build_replay`, placed by :func:`materialize_from`): those equal plain construction.

A tensor that no initializer sets (its storage is filled with NaN, or the integer type's
minimum, until one does) is refused with the module's name and the fix. No Lightning here.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["agreed_seed", "covers", "has_meta_tensors", "materialize", "materialize_from", "module_seed"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the ``meta`` device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def agreed_seed() -> int:
    """Global rank 0's ``torch.initial_seed()`` (what ``seed_everything`` set) on every rank: the seed to materialize with."""
    seed = [torch.initial_seed()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def module_seed(seed: int, name: str, phase: str = "init") -> int:
    """The seed of module ``name``'s initialization: a stable 63-bit hash (Python's ``hash`` of a str differs per process)."""
    digest = hashlib.blake2b(f"{seed}:{phase}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _fill_unset(t: Tensor) -> None:
    """Mark storage as not yet initialized: NaN, or an integer type's minimum (a bool cannot be marked)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unset(t: Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def _per_module_initializer(module: nn.Module) -> Callable[[nn.Module], Any] | None:
    """``module._init_weights`` when it initializes one given module (``_init_weights(module)``), else None."""
    fn = getattr(module, "_init_weights", None)
    if not callable(fn):
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return fn if positional else None


Slots = dict[str, list[tuple[dict[str, Any], str, torch.dtype]]]  # module name -> its materialized (table, key, dtype)


def _allocate(module: nn.Module, keep: Callable[[Tensor], bool] | None, device: torch.device | str) -> tuple[dict[int, Tensor], Slots]:
    """Fresh storage on ``device`` (marked unset) for the ``meta`` tensors of ``module`` that ``keep`` accepts, put in
    their places (a tied tensor stays one tensor): the new tensors by the old ones' ids, and the slots per module."""
    made: dict[int, Tensor] = {}  # id of a meta tensor -> its materialized self (tied tensors stay tied)
    own: Slots = {}
    for name, m in module.named_modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for key, t in list(table.items()):
                if t is None or not t.is_meta or (keep is not None and not keep(t)):
                    continue
                new = made.get(id(t))
                if new is None:
                    data = torch.empty_like(t, device=device)
                    _fill_unset(data)
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                    made[id(t)] = new
                table[key] = new
                own.setdefault(name, []).append((table, key, t.dtype))
    return made, own


def covers(module: nn.Module, values: Mapping[str, Tensor]) -> bool:
    """Whether ``values`` (by name) has a tensor of the same shape for every ``meta`` tensor of ``module``. Dtypes may
    differ: the module may have been converted since it was built (Lightning's ``precision="64-true"`` doubles every
    floating tensor, a rotary table made in float32 too); :func:`materialize_from` converts as it copies."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return all(n in values and values[n].shape == t.shape for n, t in named if t.is_meta)


@torch.no_grad()
def materialize_from(
    module: nn.Module, values: Mapping[str, Tensor], keep: Callable[[Tensor], bool] | None = None, device: torch.device | str = "cpu"
) -> int:
    """Give storage on ``device`` to the ``meta`` tensors of ``module`` that ``keep`` accepts (all by default), filled
    from ``values`` by name (:func:`covers` must hold: a build of the same network), in the module's dtypes. Returns how
    many were materialized."""
    made, own = _allocate(module, keep, device)
    for name, slots in own.items():
        for table, key, _ in slots:
            table[key].copy_(values[f"{name}.{key}" if name else key])
    return len(made)


@torch.no_grad()
def materialize(
    module: nn.Module, seed: int, keep: Callable[[Tensor], bool] | None = None, device: torch.device | str = "cpu"
) -> int:
    """Give storage on ``device`` to the ``meta`` tensors of ``module`` that ``keep`` accepts (all by default) and
    initialize them (see the module docstring). Returns how many tensors were materialized.

    ``seed`` must be the same wherever the same model is materialized (every rank of a pipeline).
    Raises ``ValueError`` naming the first module whose tensors no initializer set.
    """
    made, own = _allocate(module, keep, device)
    if not made:
        return 0
    modules = dict(module.named_modules())  # in pre-order
    names = list(modules)
    touched = {""}  # modules with a materialized tensor in their subtree
    for n in own:
        parts = n.split(".")
        touched.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    initializer: dict[str, Callable[[nn.Module], Any] | None] = {}
    for n in names:  # the nearest enclosing (or own) per-module initializer
        fn = _per_module_initializer(modules[n])
        initializer[n] = fn if fn is not None or not n else initializer[n.rpartition(".")[0]]
    for n in reversed(names):  # children before parents, as transformers' initialize_weights
        fn = initializer[n]
        if n in touched and fn is not None:
            with _seeded(module_seed(seed, n)):
                fn(modules[n])
    for n, slots in own.items():
        if not any(_unset(table[key]) for table, key, _ in slots):
            continue
        m, fn = modules[n], initializer[n]
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            with _seeded(module_seed(seed, n, "reset")):
                reset()
            if fn is not None:
                with _seeded(module_seed(seed, n)):
                    fn(m)
        unset = [key for table, key, _ in slots if _unset(table[key])]
        if unset:
            how = "no reset_parameters()" if not callable(reset) else "a reset_parameters() that leaves them unset"
            model = " nor the model's _init_weights(module)" if fn is not None else ""
            raise ValueError(
                f"cannot initialize {n or type(module).__name__!r} ({type(m).__name__}) after building it on the meta "
                f"device: it has {how}{model} for {unset}; give {type(m).__name__} a reset_parameters() that "
                "initializes its own tensors, or build the network in __init__ instead of configure_model"
            )
    for slots in own.values():  # a reset that built a new tensor (litgpt's rotary cache) keeps the built dtype
        for table, key, dtype in slots:
            t = table[key]
            if t.dtype != dtype:
                table[key] = nn.Parameter(t.to(dtype), requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else t.to(dtype)
    return len(made)
