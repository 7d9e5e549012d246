"""State a model's forward mutates, which recomputation or micro-batching would repeat.

Strategies that re-run a block (activation checkpointing recomputes it in backward) or
run the model once per micro-batch call a block's forward more often than plain training
does. Whatever the forward writes besides its output is then written again: a KV cache
appends the same keys and values twice (transformers' ``DynamicCache``: "The size of
tensor a (64) must match the size of tensor b (32)" deep inside attention), a counter
counts twice, running statistics move twice. This module finds and neutralizes that
state, or refuses it in one line naming the module, before it turns into a shape error
or silently different weights. No Lightning here: the strategies call it at setup and
around block calls.

What it handles:

- transformers models: :func:`disable_kv_cache` turns ``config.use_cache`` off for
  training (strategies go through :class:`KVCacheSwitch`, the one place they switch it), as transformers' own Trainer does under gradient checkpointing, and hands back
  the names it changed (to say so once) and a ``restore()`` for the end of fit. Only
  ``config.use_cache`` is touched: it is what a training forward reads;
  ``generation_config.use_cache`` is read by ``generate()`` alone, so generation after fit
  behaves as the user configured it either way.
- a block called with a transformers ``Cache`` anyway (``use_cache=True`` or
  ``past_key_values=`` passed explicitly in ``training_step``): :func:`cache_argument`
  finds it among the call's arguments; the strategies refuse such a call before the
  forward runs (a cache is Python state, nothing we can snapshot and put back).
- buffers a block writes in place or replaces during its forward (litgpt's ``KVCache``
  written when the forward gets ``input_pos``, BatchNorm running statistics, counters;
  a litgpt model with a cache set by ``set_kv_cache`` but called without ``input_pos``, as
  training does, writes nothing and trains as it is):
  :func:`buffer_versions` / :func:`mutated_buffers` see them through the tensors' version
  counters, which every in-place op bumps: a dictionary of a block's buffers before the
  call and a comparison after it, no copies and no hooks on the model, so it is cheap
  enough to run on every call. BatchNorm's kernel writes its running statistics without
  bumping the counter, so a training-mode BatchNorm is known by its class instead. A strategy either restores them after a recomputation
  (:class:`BufferRestore`) or refuses them.

What it does not see: state kept in plain Python attributes of a module (a list a
forward appends to, a step counter stored as an ``int``), or written outside the blocks'
own buffers (a global, another module's attribute). Such a forward is recomputed as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "CacheSettings",
    "BufferRestore",
    "buffer_versions",
    "cache_argument",
    "disable_kv_cache",
    "KVCacheSwitch",
    "describe_cache_refusal",
    "mutated_buffers",
]


class CacheSettings(list):  # list[str]: the changed settings, with a way back
    """The ``use_cache`` settings :func:`disable_kv_cache` turned off (qualified names).

    A plain ``list[str]`` to read and print; :meth:`restore` puts every setting back
    (strategies call it at teardown, so the model generates with its cache after fit).
    """

    def __init__(self, changed: Iterable[tuple[str, Any, Any]] = ()) -> None:
        self._changed = list(changed)  # (name, config object, its previous value)
        super().__init__(name for name, _, _ in self._changed)

    def notice(self, owner: str, recompute: str) -> str:
        """The one line a strategy says when it turned the settings off, in the words of
        transformers' Trainer under gradient checkpointing; ``recompute`` names what the
        strategy does to blocks (``"recomputing"``, ``"re-materializing"``)."""
        return (
            f"{owner}: `use_cache=True` is incompatible with {recompute} blocks (the KV cache would grow twice). "
            f"Setting `use_cache=False` ({', '.join(self)}) for this run; restored at teardown"
        )

    def restore(self) -> None:
        """Give every changed config its previous ``use_cache`` back (idempotent)."""
        for _, config, previous in self._changed:
            config.use_cache = previous
        self._changed.clear()
        self.clear()


def disable_kv_cache(model: nn.Module) -> CacheSettings:
    """Set ``use_cache=False`` on every config in ``model`` that has it on.

    A transformers model keeps its config on the top model and its submodels (often the
    same object); each config object is changed once and named after the first module
    that holds it (``"config.use_cache"``, ``"model.config.use_cache"``).
    """
    changed: list[tuple[str, Any, Any]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            changed.append((f"{name}.config.use_cache" if name else "config.use_cache", config, True))
            config.use_cache = False
    return CacheSettings(changed)


class KVCacheSwitch:
    """The one way a strategy switches transformers' ``use_cache`` off for a fit and back at teardown.

    A strategy that re-runs blocks holds one, calls :meth:`off` where it knows the blocks
    will be re-run (its own condition: checkpointing on, more than one micro-batch), says
    the notice it gets back once in its own voice (a warning, or an info line), and calls
    :meth:`restore` at teardown. A second :meth:`off` before :meth:`restore` changes nothing
    and says nothing, so a strategy may call it from a hook that runs more than once per fit.
    """

    def __init__(self, owner: str, recompute: str) -> None:
        self.owner = owner  # who says it: "L2LOffloadStrategy"
        self.recompute = recompute  # what the strategy does to blocks: "recomputing", "re-materializing"
        self.settings: CacheSettings | None = None  # what was turned off; None before off() and after restore()

    def off(self, model: nn.Module) -> str | None:
        """Turn ``use_cache`` off on every config in ``model``; the one line to say, or None when nothing changed."""
        if self.settings is not None:
            return None
        self.settings = disable_kv_cache(model)
        return self.settings.notice(self.owner, self.recompute) if self.settings else None

    def restore(self) -> None:
        """Give the configs their ``use_cache`` back (idempotent)."""
        if self.settings is not None:
            self.settings.restore()
            self.settings = None


def _is_transformers_cache(value: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def cache_argument(args: tuple, kwargs: Mapping[str, Any]) -> str | None:
    """The name of the argument holding a transformers ``Cache`` (``"args[2]"`` when
    positional), or None. Looks at the top-level arguments only: that is where
    transformers passes its cache to its layers (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    for key, value in kwargs.items():
        if _is_transformers_cache(value):
            return key
    for index, value in enumerate(args):
        if _is_transformers_cache(value):
            return f"args[{index}]"
    return None


def describe_cache_refusal(owner: str, name: str, module: nn.Module, argument: str, value: Any, why: str) -> str:
    """One line: which block got a cache, why that cannot work here, and the fix."""
    return (
        f"{owner}: block {name!r} ({type(module).__name__}) was called with a {type(value).__name__} "
        f"({argument}); {why} would write its keys and values into the cache again; do not pass "
        "use_cache=True or a cache (cache= / past_key_values=) when training (config.use_cache is already off)"
    )


def buffer_versions(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Each buffer of ``module`` (recursively) -> (tensor identity, version counter)."""
    return {
        f"{m_name}.{b}" if m_name else b: (id(buf), buf._version)
        for m_name, m in module.named_modules()
        for b, buf in m._buffers.items()
        if buf is not None
    }


def mutated_buffers(module: nn.Module, before: Mapping[str, tuple[int, int]], exempt: tuple[type, ...] = ()) -> list[str]:
    """Buffers of ``module`` written in place, replaced or added since ``before``.

    Buffers owned by a module of a class in ``exempt`` (e.g. BatchNorm, which a strategy
    handles by itself) are left out. One walk over the modules, no tensor read: tens of
    microseconds for a transformer layer.
    """
    out = []
    for m_name, m in module.named_modules():
        if exempt and isinstance(m, exempt):
            continue
        # BatchNorm's kernel updates the running statistics without bumping their version counter: known by class
        stats = isinstance(m, _BatchNorm) and m.training and m.track_running_stats
        for b, buf in m._buffers.items():
            if buf is None:
                continue
            name = f"{m_name}.{b}" if m_name else b
            if (stats and b in ("running_mean", "running_var")) or before.get(name) != (id(buf), buf._version):
                out.append(name)
    return out


class BufferRestore:
    """Puts back the buffers a block's forward writes, after each recomputation.

    The first (real) forward shows which buffers change (:meth:`observe`); a recomputation
    of the same block then runs inside :meth:`recompute`, which snapshots exactly those
    buffers and copies them back afterwards, also when the recomputation stops early
    (``torch.utils.checkpoint`` stops a non-reentrant recomputation by raising once it has
    what backward needs). Buffers replaced rather than written in place are put back as
    the tensors they were.
    """

    def __init__(self) -> None:
        self._mutable: dict[int, list[str]] = {}  # id(block) -> buffers its forward writes

    def observe(self, block: nn.Module, before: Mapping[str, tuple[int, int]], exempt: tuple[type, ...] = ()) -> None:
        """Note the buffers ``block`` wrote since ``before`` (its :func:`buffer_versions`)."""
        changed = mutated_buffers(block, before, exempt)
        if changed:
            known = self._mutable.setdefault(id(block), [])
            known.extend(n for n in changed if n not in known)

    @contextmanager
    def recompute(self, block: nn.Module) -> Iterator[None]:
        names = self._mutable.get(id(block))
        if not names:
            yield
            return
        owners = {n: _owner(block, n) for n in names}
        saved = {n: owner._buffers[attr] for n, (owner, attr) in owners.items()}
        kept = {n: t.clone() for n, t in saved.items() if t is not None}
        try:
            yield
        finally:
            for n, (owner, attr) in owners.items():
                original = saved[n]
                if original is not None and owner._buffers[attr] is original:
                    original.copy_(kept[n])  # written in place: the old values back
                else:
                    owner._buffers[attr] = original  # replaced: the old tensor back


def _owner(block: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    path, _, attr = qualified.rpartition(".")
    return (block.get_submodule(path) if path else block), attr
