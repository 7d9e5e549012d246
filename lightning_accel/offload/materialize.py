"""A model built on the meta device, given real tensors one offload unit at a time.

A model bigger than host RAM cannot be built whole and then offloaded: it would have to exist in memory
first. Built on ``meta`` instead (``with torch.device("meta")`` or ``trainer.init_module(empty_init=True)``
in ``configure_model``, or :func:`load_by_block` for a ``save_pretrained`` directory), it is materialized
here module by module, in the order the modules would have been initialized on the CPU, each tensor
allocated where the offload keeps it:

- a unit the caller keeps on disk (the NVMe tier's units) is allocated in a staging file of its own under
  ``nvme_path`` (mapped shared, unlinked at once so nothing is left behind) and, once its last tensor is
  filled, written back and dropped from the page cache (``msync``, ``posix_fadvise(DONTNEED)``): host
  memory holds at most one such unit's new pages at a time. The tier then moves it into its own files by
  reading the map, and :func:`settle` brings the units it keeps in memory into anonymous memory;
- every other tensor (the resident unit, or everything without a tier) is allocated in memory.

A tensor is filled from the checkpoint registered with :func:`load_by_block` (one tensor read at a time with
``safetensors.safe_open``, cast as ``from_pretrained`` casts: the same values bit for bit), else by its
module's initializer: transformers' ``_init_weights`` of the nearest ``PreTrainedModel`` (what
``from_config`` runs), else the module's ``reset_parameters()`` (what Lightning's FSDP strategy runs for a
module built on meta). A module with meta tensors and neither is refused before anything is allocated
(:func:`check`). Nothing here imports Lightning.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from lightning_accel.offload.disk_io import align_up


def meta_names(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s parameters and buffers on the meta device."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


class Checkpoint:
    """The safetensors files of a ``save_pretrained`` directory, read one tensor at a time."""

    def __init__(self, path: str | os.PathLike[str], base_prefix: str = "") -> None:
        self.path = Path(path)
        self.base_prefix = base_prefix
        index = self.path / "model.safetensors.index.json"
        if (self.path / "model.safetensors").is_file():
            files = {self.path / "model.safetensors"}
        elif index.is_file():
            files = {self.path / f for f in json.loads(index.read_text())["weight_map"].values()}
        else:
            raise ValueError(f"{self.path} has no model.safetensors (or its index); loading by block reads safetensors "
                             "files only: write the directory again with save_pretrained(safe_serialization=True)")
        from safetensors import safe_open

        self._open = safe_open
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(files):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    self.files[name] = file
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def find(self, key: str) -> str | None:
        """The name ``key`` (a name in the model) has in the files: itself, or without the model's base prefix (a
        base model's save, such as the hub's gpt2, loaded into its causal-LM model)."""
        if key in self.shapes:
            return key
        bare = key.removeprefix(f"{self.base_prefix}.") if self.base_prefix else key
        return bare if bare != key and bare in self.shapes else None

    def read_into(self, name: str, out: Tensor) -> None:
        """Copy tensor ``name`` into ``out`` (cast to its dtype, as ``from_pretrained`` casts)."""
        with self._open(self.files[name], framework="pt") as f:
            out.copy_(f.get_tensor(name))


_CHECKPOINTS: weakref.WeakKeyDictionary[nn.Module, Checkpoint] = weakref.WeakKeyDictionary()


def load_by_block(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Mark ``model`` (built on meta from the directory's config) to be filled from the ``save_pretrained`` directory
    ``path`` when the L2L strategy materializes it, instead of from its initializer. Returns ``model``."""
    _CHECKPOINTS[model] = Checkpoint(path, str(getattr(model, "base_model_prefix", "") or ""))
    return model


def loads_by_block(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules was marked by :func:`load_by_block` (on meta, to be filled from its
    directory by an L2L strategy)."""
    return any(m in _CHECKPOINTS for m in module.modules())


def _is_hf_model(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__) and hasattr(module, "_init_weights")


@dataclass
class _Route:
    """How each module of the model is filled: its checkpoint (and its name there), its transformers model."""

    checkpoint: dict[nn.Module, tuple[Checkpoint, str]] = field(default_factory=dict)
    hf_owner: dict[nn.Module, nn.Module] = field(default_factory=dict)
    order: list[tuple[str, nn.Module]] = field(default_factory=list)


def _route(model: nn.Module) -> _Route:
    route = _Route()
    named = list(model.named_modules())
    for _, module in named:  # pre-order: an inner registration or transformers model wins over an outer one
        checkpoint, hf = _CHECKPOINTS.get(module), _is_hf_model(module)
        for sub_name, sub in module.named_modules() if checkpoint is not None or hf else ():
            if checkpoint is not None:
                route.checkpoint[sub] = (checkpoint, sub_name)
            if hf:
                route.hf_owner[sub] = module
    # the order the CPU would initialize in: transformers' initialize_weights applies children first, Lightning's
    # FSDP materialization (and a plain module's construction) goes parent first
    route.order = _post_order(model) if route.hf_owner else named
    return route


def _post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        out += _post_order(child, f"{prefix}.{name}" if prefix else name)
    return [*out, (prefix, module)]


def _own_meta(module: nn.Module) -> list[tuple[str, Tensor, bool]]:
    """(name, tensor, is a parameter) of ``module``'s own meta tensors."""
    params = [(n, p, True) for n, p in module._parameters.items() if p is not None and p.is_meta]
    return params + [(n, b, False) for n, b in module._buffers.items() if b is not None and b.is_meta]


def _initializer(route: _Route, module: nn.Module) -> Callable[[], None] | None:
    owner = route.hf_owner.get(module)
    if owner is not None:
        return lambda: owner._init_weights(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def check(model: nn.Module, owner: str, route: _Route | None = None) -> None:
    """Refuse, before anything is allocated, a meta tensor nothing here can fill: a parameter the registered checkpoint
    lacks (or holds in another shape), or a tensor of a module with no initializer. ``route``: :func:`_route`'s, when
    the caller has it."""
    route = _route(model) if route is None else route
    names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    parent = {id(c): m for m in model.modules() for c in m.children()}
    for _, module in route.order:
        own = _own_meta(module)
        if not own:
            continue
        if _peft(module) or _peft(parent.get(id(module))):
            # an adapter's layers have inits of peft's own (LoRA's B starts at zero) that neither initializer here knows
            raise ValueError(f"{owner}: {names[id(own[0][1])]} is on the meta device inside a peft adapter's layer, which only "
                             "peft can initialize; build the adapted model on the CPU (load_by_block=false)")
        found = route.checkpoint.get(module)
        for name, tensor, is_param in own:
            key = f"{found[1]}.{name}" if found and found[1] else name
            stored = found[0].find(key) if found else None
            if found and stored is not None:
                if found[0].shapes[stored] != tuple(tensor.shape):
                    raise ValueError(f"{owner}: parameter {names[id(tensor)]} has shape {tuple(tensor.shape)} but {found[0].path} "
                                     f"holds {stored} as {found[0].shapes[stored]}; keep config.json and the weights from the same save_pretrained")
                continue
            if found and is_param and not _tied_elsewhere(model, tensor, found[0], route):
                raise ValueError(f"{owner}: parameter {names[id(tensor)]} is on the meta device and {found[0].path} has no "
                                 f"tensor {key}; point load_by_block at the save_pretrained directory of this model")
            if _initializer(route, module) is None:
                kind = "parameter" if is_param else "buffer"
                raise ValueError(
                    f"{owner}: {kind} {names[id(tensor)]} is on the meta device and {type(module).__name__} has no "
                    "reset_parameters() to initialize it; give it one, build the model on the CPU (no torch.device('meta') "
                    "or empty_init in configure_model), or load its weights with lightning_accel.offload.materialize.load_by_block")


def _peft(module: nn.Module | None) -> bool:
    return module is not None and type(module).__module__.startswith("peft.")


def _tied_elsewhere(model: nn.Module, tensor: Tensor, checkpoint: Checkpoint, route: _Route) -> bool:
    """A tied parameter saved under another of its names (``lm_head.weight`` saved as ``model.embed_tokens.weight``)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is tensor:
                found = route.checkpoint.get(module)
                if found and checkpoint.find(f"{found[1]}.{name}" if found[1] else name) is not None:
                    return True
    return False


class Staging:
    """Each disk unit's tensors in a file of its own under ``directory``, mapped shared and unlinked at once."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._maps: dict[int, tuple[np.memmap, int, int]] = {}  # unit -> (map, fd, next free offset)
        # every map made, held until close(): while held, its addresses cannot be reused by another map (the tier's),
        # so an address in one of these ranges is a staged tensor's
        self._held: list[np.memmap] = []
        self.ranges: list[tuple[int, int]] = []

    def open(self, unit: int, nbytes: int) -> None:
        fd, path = tempfile.mkstemp(prefix="lightning-accel-materialize-", dir=self.directory)
        os.unlink(path)  # the map keeps the file; nothing is left behind, whatever ends the run
        os.ftruncate(fd, max(nbytes, 1))
        mapped = np.memmap(open(fd, "r+b", closefd=False), dtype=np.uint8, mode="r+", shape=(max(nbytes, 1),))
        self._maps[unit] = (mapped, fd, 0)
        self._held.append(mapped)
        start = mapped.ctypes.data
        self.ranges.append((start, start + mapped.size))

    def alloc(self, unit: int, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        mapped, fd, at = self._maps[unit]
        nbytes = shape.numel() * dtype.itemsize
        self._maps[unit] = (mapped, fd, at + align_up(nbytes))  # each staged tensor starts on a page
        return torch.from_numpy(mapped[at:at + nbytes]).view(dtype).view(shape)

    def finish(self, unit: int) -> None:
        """The unit is filled: written to its file, and its pages let go (ours and the page cache's)."""
        mapped, fd, _ = self._maps.pop(unit)
        mapped.flush()  # msync: the pages are clean, so they may be dropped
        mapped._mmap.madvise(mmap.MADV_DONTNEED)  # type: ignore[attr-defined]
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is a view of a staging file (valid until :meth:`close`)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(start <= ptr < end for start, end in self.ranges)

    def close(self) -> None:
        """Let the maps go: each file is freed once no tensor views it any more (the tier's copies replaced them)."""
        for unit in list(self._maps):
            self.finish(unit)
        self._held.clear()
        self.ranges.clear()


@dataclass
class Materialized:
    """What :func:`materialize` did: where the tensors went, and the most new bytes it held in memory at once."""

    staging: Staging | None
    in_memory_bytes: int = 0  # allocated in memory, kept there (the units not on disk)
    staged_bytes: int = 0  # written to staging files
    peak_bytes: int = 0  # in memory at once: the kept bytes plus the one disk unit being filled

    def describe(self) -> str:
        gib = 2**30
        return (f"materialized from meta block by block: {self.in_memory_bytes / gib:.3f} GiB in memory, "
                f"{self.staged_bytes / gib:.3f} GiB through staging files (at most {self.peak_bytes / gib:.3f} GiB new in memory at once)")


def materialize(model: nn.Module, unit_of: dict[int, int], on_disk: Iterable[int], staging_dir: str | None,
                owner: str = "L2LOffloadStrategy") -> Materialized:
    """Give every meta tensor of ``model`` real values, module by module. ``unit_of``: id of a meta tensor (parameter
    or buffer) -> its unit's index; ``on_disk``: the units allocated in staging files under ``staging_dir`` (the
    others in memory). Meta parameters are replaced by new ``nn.Parameter`` objects (a meta tensor cannot take CPU
    data), tied ones by the same one, so plan the units again afterwards."""
    route = _route(model)
    check(model, owner, route)
    disk = set(on_disk) if staging_dir is not None else set()
    staging = Staging(staging_dir) if disk and staging_dir is not None else None
    left: dict[int, int] = {}  # unit -> its meta tensors not yet filled
    size: dict[int, int] = {}
    seen: set[int] = set()
    for _, module in route.order:
        for _, tensor, _ in _own_meta(module):
            unit = unit_of.get(id(tensor), -1)
            if id(tensor) not in seen:
                seen.add(id(tensor))
                left[unit] = left.get(unit, 0) + 1
                size[unit] = size.get(unit, 0) + align_up(tensor.numel() * tensor.element_size())
    done = Materialized(staging)
    filling: dict[int, int] = {}  # disk unit being filled -> its bytes so far
    replaced: dict[int, nn.Parameter] = {}
    for _, module in route.order:
        own = _own_meta(module)
        fresh = []
        for name, tensor, is_param in own:
            if id(tensor) in replaced:  # a tied parameter, made with its first owner
                module._parameters[name] = replaced[id(tensor)]
                continue
            unit = unit_of.get(id(tensor), -1)
            if unit in disk and is_param:  # (buffers are small, and written by the compute: kept in memory)
                assert staging is not None
                if unit not in staging._maps:
                    staging.open(unit, size[unit])
                data = staging.alloc(unit, tensor.shape, tensor.dtype)
                done.staged_bytes += data.nbytes
                filling[unit] = filling.get(unit, 0) + data.nbytes
            else:
                data = torch.empty(tensor.shape, dtype=tensor.dtype)
                done.in_memory_bytes += data.nbytes
            if is_param:
                new = nn.Parameter(data, requires_grad=tensor.requires_grad)
                new.__dict__.update(tensor.__dict__)
                module._parameters[name] = replaced[id(tensor)] = new
            else:
                module._buffers[name] = data
            fresh.append((name, unit, data))
        if not fresh:
            continue
        _fill(route, module, [(n, d) for n, _, d in fresh])
        done.peak_bytes = max(done.peak_bytes, done.in_memory_bytes + sum(filling.values()))
        for _, unit, _ in fresh:
            left[unit] -= 1
            if left[unit] == 0 and unit in filling:
                assert staging is not None
                staging.finish(unit)
                del filling[unit]
    return done


@torch.no_grad()
def _fill(route: _Route, module: nn.Module, fresh: list[tuple[str, Tensor]]) -> None:
    """Fill ``module``'s new tensors: from its checkpoint where it holds them, else (and first) its initializer."""
    found = route.checkpoint.get(module)
    keys = {name: found[0].find(f"{found[1]}.{name}" if found[1] else name) for name, _ in fresh} if found else {}
    from_file = [(n, d) for n, d in fresh if keys.get(n) is not None]
    if len(from_file) < len(fresh):
        init = _initializer(route, module)
        assert init is not None  # check() refused it otherwise
        init()
    for name, data in from_file:
        assert found is not None
        found[0].read_into(keys[name] or name, data)


def settle(params: Iterable[nn.Parameter], master: dict[nn.Parameter, Tensor], shadow: dict[nn.Parameter, Tensor],
           staging: Staging, pin: bool) -> int:
    """After the tier took its units to its files (the parameters it spilled are views of those now): the parameters
    still staged (units the plan keeps in memory) move into memory (pinned with ``pin``), as if they had been built there;
    the store's tables follow. Returns their bytes."""
    moved = 0
    for param in params:
        if not staging.holds(param.data):
            continue
        data = param.data.clone()
        if pin:
            data = data.pin_memory()
        if master.get(param) is not None and staging.holds(master[param]):
            if shadow.get(param) is master[param]:
                shadow[param] = data
            master[param] = data
        param.data = data
        moved += data.nbytes
    return moved
