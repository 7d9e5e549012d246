"""The single-process pipeline: a model's blocks placed stage by stage on local devices.

The user's modules are not wrapped: each block keeps its place and name in the model
(so checkpoints keep the user's parameter names and load into the unpipelined model),
and gets an instance-level ``forward`` that moves its inputs to its stage's device and,
for micro-batches before ``checkpoint_stop``, re-materializes activations in the
backward pass (``torch.utils.checkpoint``) instead of storing them.

Re-materialization covers a whole stage per micro-batch, as in torchgpipe: when a
stage's first block is called, all of the stage's blocks run inside one checkpoint, so
only the stage's input is kept per micro-batch, and backward recomputes one micro-batch
of one stage at a time. The activation peak then shrinks with M; checkpointing block by
block would keep every block boundary of the whole batch. The stage run chains the
blocks (block ``k + 1`` gets block ``k``'s output), which the executor does not assume:
it watches the model's own forward, block by block, and chains a stage only once it has
seen each of its blocks called with exactly the previous block's output (the same tensor
object) and nothing else; until then, and for models that do something between blocks,
each block is its own checkpoint. The later calls of a chained stage's blocks return the
outputs the stage run made (they are the checkpoint's outputs, so gradients through any
use of them are exact).

Modules outside
the blocks run on the stage of the block registered before them (the first stage when
none is), which attaches an embedding to the first stage and a head to the last. The
model's output is moved back to the first device, where the batch and its targets live.
BatchNorm layers never update their running statistics during recomputation; with
``deferred_batch_norm`` they update them once per batch, from the whole batch
(:mod:`lightning_accel.pipeline.batchnorm`); call :meth:`finish_batch` after the last
micro-batch.

Other state a block's forward writes would be written once per micro-batch and again by
its recomputation (:mod:`lightning_accel.models.side_effects`): a block about to be
re-materialized that is called with a transformers KV cache is refused before it runs
(the recomputation would append to the cache again); buffers a block writes are put back
after each recomputation, and refused when a second micro-batch writes them again (plain
training writes them once per batch).

On CUDA the host issues micro-batch ``i + 1``'s first stage while later devices still
run micro-batch ``i`` (kernel launches are asynchronous), so the stages overlap on the
devices' own streams, and copies between stages run on per-device copy streams
(:mod:`lightning_accel.pipeline.streams`) so they overlap compute too; on CPU the
micro-batches run one after another and only the arithmetic of GPipe (memory, exact
gradients) applies.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from lightning_accel.models.block_policy import Block
from lightning_accel.models.side_effects import BufferRestore, buffer_versions, cache_argument, describe_cache_refusal, mutated_buffers
from lightning_accel.patching import Patch, patch, remove_all
from lightning_accel.pipeline.batchnorm import DeferredBatchNorm
from lightning_accel.pipeline.microbatch import gather_output, scatter_call, tensors_in
from lightning_accel.pipeline.partition import stage_of_block
from lightning_accel.pipeline.streams import StageCopier

__all__ = ["CHECKPOINT_MODES", "LocalPipeline", "checkpoint_stop"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoint_stop(mode: str, chunks: int) -> int:
    """The policy as one integer: micro-batches with index < this are re-materialized.

    ``except_last`` keeps the last micro-batch's activations because its backward runs
    first, right after its forward, so recomputing it would buy no memory.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def _direct_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _hidden_tensor(value: Any, path: str = "output") -> str | None:
    """Where ``value`` holds a tensor inside an object the stage copies cannot enter (they carry tensors and tuples,
    lists and dicts of them), as ``"output[1].cache (Cache)"``; None when every tensor in it can be carried."""
    if value is None or isinstance(value, (Tensor, str, bytes, int, float, bool, torch.dtype, torch.device, nn.Module)):
        return None
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _hidden_tensor(v, f"{path}[{k!r}]")) is not None), None)
    if isinstance(value, (tuple, list)):
        return next((p for i, v in enumerate(value) if (p := _hidden_tensor(v, f"{path}[{i}]")) is not None), None)
    attributes = getattr(value, "__dict__", None) or {}
    holds = next((name for name, v in attributes.items() if tensors_in(v)), None)
    return None if holds is None else f"{path}.{holds} ({type(value).__name__})"


class LocalPipeline:
    """Blocks of ``net`` split into ``len(balance)`` stages on ``devices``, in one process.

    ``place()`` moves the modules and installs the per-block forwards; ``restore()``
    removes them and leaves a plain model. Around each micro-batch's forward, enter
    ``microbatch(i)`` so the blocks know whether to re-materialize.
    """

    def __init__(
        self,
        net: nn.Module,
        blocks: Sequence[Block],
        balance: Sequence[int],
        devices: Sequence[torch.device],
        checkpoint_stop: int = 0,
        deferred_batch_norm: bool = False,
        owner: str = "LocalPipeline",
    ) -> None:
        if sum(balance) != len(blocks):
            raise ValueError(f"balance {list(balance)} sums to {sum(balance)} but there are {len(blocks)} blocks")
        if len(devices) < len(balance):
            raise ValueError(f"{len(balance)} stages need {len(balance)} devices, got {len(devices)}")
        self.net = net
        self.blocks = list(blocks)
        self.balance = list(balance)
        self.devices = [torch.device(d) for d in devices[: len(balance)]]
        self.checkpoint_stop = checkpoint_stop
        self._current: int | None = None
        self._handles: list[RemovableHandle] = []
        self._patches: list[Patch] = []  # the staged block forwards, removed by restore()
        self.deferred_batch_norm = deferred_batch_norm
        self._batch_norm: DeferredBatchNorm | None = None
        self.copy = StageCopier(self.devices)
        stage_of = stage_of_block(self.balance)
        self._stage_of = stage_of
        # links[k]: block k (not first in its stage) was seen called with exactly block k-1's output: True,
        # with anything else: False (for good), not seen yet: None
        self._links: list[bool | None] = [None] * len(self.blocks)
        self._last_output: tuple[int, weakref.ref] | None = None  # (block, its latest output), to see links
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}  # block -> (expected input, output) of a stage run
        self._originals: dict[int, Callable[..., Any]] = {}  # block -> its class's forward, bound
        self.owner = owner  # who refuses, in errors raised during a forward (the strategy's name)
        self._restore = BufferRestore()  # buffers a block writes, put back after its recomputation
        self._carried: set[int] = set()  # blocks whose output was seen to hold only tensors the stage copies can move

    @property
    def stages(self) -> int:
        return len(self.balance)

    def assignment(self) -> dict[str, int]:
        """Stage of every module that owns parameters or buffers (its qualified name -> stage)."""
        stage_of = stage_of_block(self.balance)
        block_stage = {b.name: stage_of[k] for k, b in enumerate(self.blocks)}
        out: dict[str, int] = {}
        current = 0
        inside: str | None = None
        for name, module in self.net.named_modules():
            if name in block_stage:
                current, inside = block_stage[name], name
                out[name] = current
                continue
            if inside is not None and name.startswith(f"{inside}."):
                continue  # inside a block: moved with it
            if _direct_tensors(module):
                out[name] = current
        return out

    def place(self) -> None:
        """Move every module to its stage's device and install the staged forwards."""
        self.restore()
        assignment = self.assignment()
        modules = dict(self.net.named_modules())
        owner: dict[int, tuple[str, int]] = {}
        for name, stage in assignment.items():
            is_block = any(b.name == name for b in self.blocks)
            tensors = list(modules[name].parameters()) if is_block else _direct_tensors(modules[name])
            for t in tensors:
                seen = owner.setdefault(id(t), (name, stage))
                if self.devices[seen[1]] != self.devices[stage]:
                    raise ValueError(
                        f"a tensor is shared by {seen[0] or 'the model'} (stage {seen[1]}, {self.devices[seen[1]]}) "
                        f"and {name} (stage {stage}, {self.devices[stage]}); a pipeline cannot hold one tensor on two "
                        "devices; untie the weights (e.g. GPT(tie_weights=False)) or put both stages on one device"
                    )
        # a training forward inside microbatch(i) is a micro-batch of this batch; one outside it is a recomputation,
        # which must not update BatchNorm running statistics a second time. Installed before the blocks' forwards, so a
        # BatchNorm that is a block itself is recomputed through it too (the block's checkpoint calls what it wraps)
        self._batch_norm = DeferredBatchNorm(self.net, lambda: self._current is not None, self.deferred_batch_norm)
        for name, stage in assignment.items():
            module, device = modules[name], self.devices[stage]
            if any(b.name == name for b in self.blocks):
                module.to(device)
                self._patch_block(module, device)
            else:
                module._apply(lambda t, d=device: t.to(d), recurse=False)  # its own tensors only
                self._handles.append(module.register_forward_pre_hook(self._mover(device), with_kwargs=True))
        first = self.devices[0]
        self._handles.append(self.net.register_forward_hook(lambda _m, _a, out: self.copy(out, first)))

    def finish_batch(self) -> None:
        """Call after the last micro-batch's forward: commits deferred BatchNorm statistics."""
        if self._batch_norm is not None:
            self._batch_norm.commit()

    def restore(self) -> None:
        """Remove the staged forwards and hooks; the model is a plain model again (modules stay where they are)."""
        for handle in self._handles:
            handle.remove()
        remove_all(self._patches)
        self._handles = []
        if self._batch_norm is not None:
            self._batch_norm.detach()
            self._batch_norm = None

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Run the forward of micro-batch ``index`` inside this context."""
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous
            self._pending.clear()  # a stage run's outputs that the forward never asked for
            self._last_output = None

    def run_microbatches(self, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any], chunks: int) -> tuple[Any, bool]:
        """``forward(*args, **kwargs)``, one training call of the net, as ``chunks`` micro-batches through the stages
        (each inside :meth:`microbatch`), their outputs gathered into the whole batch's; returns it and whether a scalar
        output had to be averaged over the micro-batches (:func:`~lightning_accel.pipeline.microbatch.gather_output`)."""
        calls, sizes = scatter_call(args, kwargs, chunks)
        outputs = []
        for i, (a, kw) in enumerate(calls):
            with self.microbatch(i), record_function(f"gpipe/forward microbatch {i}"):  # a profiler's label
                outputs.append(forward(*a, **kw))
        self.finish_batch()  # deferred BatchNorm: once per call, as plain training updates once per forward
        return gather_output(outputs, sizes)

    def stage_chained(self, stage: int) -> bool:
        """Whether ``stage`` is re-materialized as one checkpoint (its blocks were seen to chain)."""
        ks = [k for k, s in enumerate(self._stage_of) if s == stage]
        return all(self._links[k] for k in ks[1:])

    def _observe(self, k: int, args: tuple, kwargs: dict, output: Any) -> None:
        """Record whether block ``k`` was called with exactly block ``k - 1``'s output (and nothing else)."""
        if k > 0 and self._stage_of[k - 1] == self._stage_of[k] and self._links[k] is not False:
            last = self._last_output
            previous = last[1]() if last is not None and last[0] == k - 1 else None
            self._links[k] = previous is not None and not kwargs and len(args) == 1 and args[0] is previous
        self._last_output = (k, weakref.ref(output)) if isinstance(output, Tensor) else None

    def _stage_run(self, first: int) -> Callable[..., tuple[Tensor, ...]]:
        """The forward of the stage that starts at block ``first``, returning every block's output."""
        last = max(k for k, s in enumerate(self._stage_of) if s == self._stage_of[first])
        forwards = [self._guarded(k, self._originals[k]) for k in range(first, last + 1)]

        def run(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
            outputs = [forwards[0](*args, **kwargs)]
            for forward in forwards[1:]:
                outputs.append(forward(outputs[-1]))
            return tuple(outputs)

        return run

    def _guarded(self, k: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` of block ``k`` with its buffer writes watched in a micro-batch and undone in a recomputation.

        BatchNorm is left to :class:`DeferredBatchNorm`, which already keeps its statistics out of
        recomputations and, when asked, updates them once per batch.
        """
        block = self.blocks[k]

        def run(*args: Any, **kwargs: Any) -> Any:
            current = self._current
            if current is None:  # recomputation in backward
                with self._restore.recompute(block.module):
                    return forward(*args, **kwargs)
            before = buffer_versions(block.module)
            output = forward(*args, **kwargs)
            if k not in self._carried:  # the first micro-batch: can its output cross to another stage's device?
                hidden = _hidden_tensor(output)
                if hidden is not None:
                    raise RuntimeError(
                        f"{self.owner}: block {block.name!r} ({type(block.module).__name__}) returned a tensor inside an "
                        f"object at {hidden}, which the pipeline cannot move to the next stage's device (it carries "
                        "tensors and tuples, lists and dicts of them); return its tensors in a tuple or dict, or choose "
                        "other blocks (blocks=...)"
                    )
                self._carried.add(k)
            written = mutated_buffers(block.module, before, exempt=(_BatchNorm,))
            if written and current > 0:
                raise RuntimeError(
                    f"{self.owner}: block {block.name!r} ({type(block.module).__name__}) writes buffer "
                    f"{block.name}.{written[0]} in its forward, which runs once per micro-batch, not once per batch as "
                    "in plain training; set chunks=1, or keep that state out of the block's forward"
                )
            self._restore.observe(block.module, before, exempt=(_BatchNorm,))
            return output

        return run

    def _refuse_cache(self, k: int, args: tuple, kwargs: dict) -> None:
        """A block about to be re-materialized must not get a KV cache: the recomputation would append to it again."""
        argument = cache_argument(args, kwargs)
        if argument is not None:
            value = kwargs[argument] if argument in kwargs else args[int(argument[5:-1])]
            block = self.blocks[k]
            raise RuntimeError(describe_cache_refusal(self.owner, block.name, block.module, argument, value, "re-materializing it in backward"))

    def _mover(self, device: torch.device) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return self.copy(args, device), self.copy(kwargs, device)

        return hook

    def _patch_block(self, block: nn.Module, device: torch.device) -> None:
        original = block.forward  # the class's bound forward
        k = next(i for i, b in enumerate(self.blocks) if b.module is block)
        self._originals[k] = original
        stage = self._stage_of[k]
        first = k == 0 or self._stage_of[k - 1] != stage

        def staged_forward(*args: Any, **kwargs: Any) -> Any:
            current = self._current
            if current is None:  # evaluation, or recomputation in backward
                return original(*self.copy(args, device), **self.copy(kwargs, device))
            if k in self._pending:  # a later block of a stage run: hand back what the run computed
                expected, output = self._pending.pop(k)
                if not kwargs and len(args) == 1 and args[0] is expected:
                    self._last_output = (k, weakref.ref(output))
                    return output
                self._pending.clear()
                self._links[k] = False
                warnings.warn(
                    f"pipeline stage {stage}: block {self.blocks[k].name!r} was called with something other than the "
                    "previous block's output, after earlier batches chained them; its stage is re-materialized block "
                    "by block from now on (correct, slower; deferred BatchNorm statistics of this batch may include "
                    "the discarded run)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            moved_args, moved_kwargs = self.copy(args, device), self.copy(kwargs, device)
            if current < self.checkpoint_stop and torch.is_grad_enabled():
                self._refuse_cache(k, args, kwargs)
                if first and self.stage_chained(stage) and k + 1 < len(self.blocks) and self._stage_of[k + 1] == stage:
                    outputs = checkpoint(self._stage_run(k), *moved_args, use_reentrant=False, **moved_kwargs)
                    for j in range(1, len(outputs)):
                        self._pending[k + j] = (outputs[j - 1], outputs[j])
                    self._last_output = (k, weakref.ref(outputs[0]))
                    return outputs[0]
                output = checkpoint(self._guarded(k, original), *moved_args, use_reentrant=False, **moved_kwargs)
            else:
                output = self._guarded(k, original)(*moved_args, **moved_kwargs)
            self._observe(k, args, kwargs, output)
            return output

        # an instance attribute: names and state_dict untouched, and a forward the user's instance already had comes back
        self._patches.append(patch(block, "forward", staged_forward))
