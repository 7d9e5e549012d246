"""Stage boundaries inside a model's own forward: one rank runs its blocks, the others' become receive and send points.

Why this and not a traced graph: the models people bring (transformers Llama, GPT-2,
Qwen2, Mistral, litgpt GPT) call their blocks from their own loop with extra
arguments (attention masks, position ids, rotary cos/sin) that the model computes
before the first block. Here every rank runs the model's own code, unchanged, on its
micro-batch: what comes before the first block (embeddings, masks, rotary tables) is
recomputed on each rank, so every block gets the arguments the model gives it, and
the user's module, parameter names and loss code stay as they are. Only each stage's
block output crosses ranks.

While :meth:`StageBoundaries.run` runs the model for stage ``s`` (blocks
``start .. end - 1``):

- a block before ``start`` (another rank's, on the ``meta`` device) runs on ``meta``
  (shapes only, no arithmetic, no storage), or, where it has the class of the block
  that hands the stage its input and that block's output structure came with torch's
  shape metadata, does not run at all; its output becomes zeros on this rank's
  device, and the last one's output is the activation received from stage ``s - 1``,
  so the model's own code between blocks carries it to block ``start``. A block seen to
  return one bare tensor of the received activation's shape is not run at all after
  that: the received activation stands in for its output;
- blocks ``start .. end - 1`` run as usual;
- after block ``end - 1`` the forward stops (unless ``s`` is the last stage) and
  :meth:`run` returns that block's output, which goes to stage ``s + 1``; the last
  stage runs on to the model's output and the loss.

A stage sends the tensors of its last block's output: one tensor (transformers'
``(hidden_states,)``, ``(hidden_states, None)``: the hidden state alone), or several as a
tuple (a block returning ``(hidden, aux)``), which the next stage puts back in the block
output's structure, in order, for the model's own code. Where the blocks are several stacks (an
encoder-decoder), a stage also sends on the last block output of each earlier stack that a later stage needs
(:mod:`lightning_accel.pipeline.stack_carry`), and a stage that receives one returns it from that block. Outside :meth:`run` the blocks run as usual (on a model whose
other stages are on ``meta`` that fails, as any use of freed weights does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Union

import pickle

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_accel.models.side_effects import cache_argument, describe_cache_refusal
from lightning_accel.patching import patch, remove_all
from lightning_accel.pipeline.microbatch import map_tensors, tensors_in
from lightning_accel.pipeline.stack_carry import carried_into, carried_out_of, stack_ends

__all__ = ["StageBoundaries"]


class _StageOutput(BaseException):
    """Stops the model's forward after a stage's last block (a BaseException: a user's ``except Exception`` cannot eat it)."""

    def __init__(self, output: Activation) -> None:
        super().__init__("stage output")
        self.output = output


Activation = Union[Tensor, tuple[Tensor, ...]]  # what a stage sends on: one tensor, or a block output's tensors


@dataclass
class _Active:
    """The stage :meth:`StageBoundaries.run` runs. ``parts``: the received tensors not yet taken (the carried stack ends
    first, in block order, then the previous stage's output: :attr:`received` once every carry is taken);
    ``carried``: stack-end outputs taken from them; ``produced``: stack-end outputs this stage computed."""

    start: int
    end: int
    last: bool
    received: Activation | None
    remat: bool
    mark: Callable[[Tensor], Tensor] | None
    into: tuple[int, ...] = ()
    parts: list[Tensor] = field(default_factory=list)
    carried: dict[int, Activation] = field(default_factory=dict)
    produced: dict[int, Activation] = field(default_factory=dict)
    handed: int = 0  # how often the block before the stage has handed it the received activation (once per forward)

    def take(self, block: int, count: int) -> Activation:
        """The next ``count`` received tensors, as stack end ``block``'s output; the rest is the previous stage's output
        once every carry is taken."""
        taken, self.parts = self.parts[:count], self.parts[count:]
        self.carried[block] = taken[0] if len(taken) == 1 else tuple(taken)
        if len(self.carried) == len(self.into):
            self.received = self.parts[0] if len(self.parts) == 1 else tuple(self.parts)
        return self.carried[block]


def _hidden(output: Any, name: str) -> Activation:
    """The tensors in a block's output, in order: the activation a stage sends on (one tensor, or a tuple of them)."""
    found = tensors_in(output)
    if not found:
        raise ValueError(
            f"block {name!r} returned no tensor ({type(output).__name__}); a pipeline stage sends its last block's "
            "tensors to the next; choose blocks (blocks=...) that return their output"
        )
    return found[0] if len(found) == 1 else tuple(found)


class _Slot:
    """Where a tensor sits in a block output's structure (:attr:`StageBoundaries.structures`)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slot)

    __hash__ = object.__hash__


def _structure(output: Any) -> Any:
    """``output`` with every tensor replaced by a :class:`_Slot`, or None where that does not pickle (what crosses
    ranks with torch's shape metadata)."""
    skeleton = map_tensors(output, lambda _t: _Slot())
    try:
        pickle.dumps(skeleton)
    except Exception:  # noqa: BLE001  # a non-tensor part that does not pickle: the receiver runs the block on meta
        return None
    return skeleton


def _slot_count(skeleton: Any) -> int:
    count = [0]

    def visit(value: Any) -> None:
        if isinstance(value, _Slot):
            count[0] += 1
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)

    visit(skeleton)
    return count[0]


def _fill(skeleton: Any, received: Activation, name: str) -> Any:
    """The block output ``skeleton`` describes, its tensors the received ones in order."""
    tensors = iter(_tensors(received))
    if _slot_count(skeleton) != len(_tensors(received)):
        raise ValueError(
            f"block {name!r} returned {_slot_count(skeleton)} tensors on the previous stage's rank but "
            f"{len(_tensors(received))} arrived; its output must have the same structure on every micro-batch"
        )

    def fill(value: Any) -> Any:
        if isinstance(value, _Slot):
            return next(tensors)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(fill(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(fill(v) for v in value)
        if isinstance(value, dict):
            return type(value)((k, fill(v)) for k, v in value.items())
        return value

    return fill(skeleton)


def _tensors(activation: Activation) -> tuple[Tensor, ...]:
    return (activation,) if isinstance(activation, Tensor) else tuple(activation)


def _stand_in(output: Any, received: Activation, name: str) -> Any:
    """``output`` (a block's, run for its structure) with its tensors replaced by the received ones, in order."""
    tensors = iter(_tensors(received))
    count = len(tensors_in(output))
    if count != len(_tensors(received)):
        raise ValueError(
            f"block {name!r} returned {count} tensors here but the previous stage sent {len(_tensors(received))}; its "
            "output must have the same structure on every micro-batch"
        )
    return map_tensors(output, lambda _t: next(tensors))


class StageBoundaries:
    """Installs stage boundaries on ``blocks`` (modules of one model, in call order) for the stages of ``balance``.

    ``names``: the blocks' names, for errors and to find where a stack ends (an encoder's last block, whose output a
    stage carries on to every later stage: :mod:`lightning_accel.pipeline.stack_carry`). :meth:`restore` removes the
    boundaries.
    """

    def __init__(self, blocks: Sequence[nn.Module], balance: Sequence[int], names: Sequence[str] | None = None) -> None:
        if sum(balance) != len(blocks):
            raise ValueError(f"balance {list(balance)} sums to {sum(balance)} but there are {len(blocks)} blocks")
        self.blocks, self.balance = list(blocks), list(balance)
        self.names = list(names) if names is not None else [f"block {k}" for k in range(len(blocks))]
        self.starts = [sum(self.balance[:s]) for s in range(len(self.balance))]
        self.stack_ends = stack_ends(self.names) if names is not None else ()
        self._active: _Active | None = None
        self._bare_shape: dict[int, torch.Size] = {}  # block -> the shape it last returned as one bare tensor (on meta)
        # block -> the structure of its output (tensors as _Slot), recorded where it ran for real at a stage's end and
        # carried to the next stage's rank with torch's shape metadata: there the received tensors are put back in it
        # without running the block on meta (a kernel may refuse meta tensors: transformers' MoE grouped_mm)
        self.structures: dict[int, Any] = {}
        # instance attributes: a forward the user's instance already had comes back at restore()
        self._patches = [patch(block, "forward", self._boundary(k, block.forward)) for k, block in enumerate(self.blocks)]

    def restore(self) -> None:
        remove_all(self._patches)

    @property
    def active_stage(self) -> int | None:
        """The stage :meth:`run` is running now (a block's hooks fire for its shadow runs too: this tells them apart)."""
        if self._active is None:
            return None
        return next(s for s, start in enumerate(self.starts) if start == self._active.start)

    def stage_range(self, stage: int) -> range:
        return range(self.starts[stage], self.starts[stage] + self.balance[stage])

    def run(
        self,
        stage: int,
        received: Activation | None,
        forward: Callable[[], Any],
        remat: bool = False,
        mark: Callable[[Tensor], Tensor] | None = None,
    ) -> Any:
        """``forward()`` (the model's own code on one micro-batch) as stage ``stage``: returns its last block's output,
        or for the last stage what ``forward`` returns. ``received``: stage ``stage - 1``'s output (None for stage 0).

        Where the blocks are several stacks (an encoder-decoder), ``received`` begins with the tensors of the stack ends
        this stage needs beyond the block that hands it its input (:meth:`carried_into`, in block order), and a stage
        that is not the last returns the stack ends the next stage needs (:meth:`carried_out_of`) before its own output,
        all as one tuple of tensors.

        ``remat``: each of the stage's blocks runs under ``torch.utils.checkpoint`` (only its inputs are kept; backward
        runs it again), so only the blocks are recomputed, never the model's or the user's code around them (a loss, a
        ``self.log``). ``mark``: applied to the first tensor the stage's first block gets (a timeline's marker)."""
        if (stage == 0) != (received is None):
            raise ValueError(f"stage {stage} {'takes no' if stage == 0 else 'needs the'} activation of the previous stage")
        blocks = self.stage_range(stage)
        last = stage == len(self.balance) - 1
        active = _Active(blocks.start, blocks.stop, last, received, remat, mark, self.carried_into(stage))
        if active.into:
            active.parts = list(_tensors(received))  # type: ignore[arg-type]
            for k in active.into:  # each carry's count from its structure; one not known yet is taken at its block
                if self.structures.get(k) is None:
                    break
                active.take(k, _slot_count(self.structures[k]))
            if len(active.carried) < len(active.into):
                active.received = None  # known once the carries before it are taken (_boundary)
        with self._running(active):
            try:
                result = forward()
            except _StageOutput as stop:
                return self._with_carries(stage, active, stop.output)
        if not last:
            raise ValueError(
                f"the model's forward returned without calling {self.names[blocks.stop - 1]!r}, the last block of "
                f"pipeline stage {stage}; every block must run on every micro-batch, in the order found"
            )
        return result

    def carried_into(self, stage: int) -> tuple[int, ...]:
        """The stack ends (block indices) ``stage`` receives beside the previous stage's output."""
        return carried_into(self.stack_ends, self.starts, stage)

    def carried_out_of(self, stage: int) -> tuple[int, ...]:
        """The stack ends ``stage`` sends on beside its own output (what the next stage receives)."""
        return carried_out_of(self.stack_ends, self.starts, stage)

    def _carriable(self, k: int, output: Any) -> Any:
        """The structure of stack end ``k``'s output, or a one-line refusal naming the block where it cannot cross ranks."""
        skeleton = _structure(output)
        if skeleton is None or not tensors_in(output):
            raise ValueError(
                f"block {self.names[k]!r} ends a stack whose output later pipeline stages need (an encoder's, for the "
                f"decoder), but its output ({type(output).__name__}) holds no tensor or something that cannot be sent "
                "between ranks; return tensors (a tuple of them) from it, or use strategy='gpipe' in one process"
            )
        return skeleton

    def _with_carries(self, stage: int, active: _Active, output: Activation) -> Activation:
        """``output`` with the stack ends the next stage needs before it: computed here, handed in (block
        ``start - 1``) or received as carries; a received tensor goes on as a copy, so autograd adds the gradient
        coming back for it to this stage's own use of it."""
        ends = self.carried_out_of(stage)
        if not ends:
            return output
        sent: list[Tensor] = []
        for k in ends:
            if k in active.produced:
                sent += _tensors(active.produced[k])
                continue
            source = active.carried.get(k) if k < active.start - 1 else active.received
            if source is None:
                raise RuntimeError(f"stage {stage} did not get the output of {self.names[k]!r}, which it carries on")
            sent += [t.clone() if t.requires_grad and torch.is_grad_enabled() else t for t in _tensors(source)]
        return (*sent, *_tensors(output))

    @contextmanager
    def _running(self, active: _Active) -> Iterator[None]:
        previous, self._active = self._active, active
        try:
            yield
        finally:
            self._active = previous

    def _boundary(self, k: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            active = self._active
            if active is None:
                return original(*args, **kwargs)
            if k < active.start:  # another stage's block: shapes only; the last one hands over the received activation
                if k == active.start - 1:
                    active.handed += 1
                    if active.handed > 1:  # it would hand over the same activation again: a silently wrong output
                        raise ValueError(
                            f"the model's forward ran {self.names[k]!r} twice in one micro-batch (the network called twice "
                            "in one step); a pipeline stage gets the previous stage's output once per micro-batch, so a "
                            "second call would reuse the first one's; call the network once per step (e.g. on the "
                            "batches concatenated), or train with strategy='ddp'"
                        )
                if k in active.carried:  # a stack's end (an encoder's output) an earlier stage carried here
                    return _fill(self.structures[k], active.carried[k], self.names[k])
                if k in active.into:  # its structure not known yet: learnt on meta, then its tensors taken
                    with torch.no_grad(), _on_meta(self.blocks[k]):
                        out = original(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
                    self.structures[k] = self._carriable(k, out)
                    return _stand_in(out, active.take(k, len(tensors_in(out))), self.names[k])
                received = active.received
                if received is None:  # carries still to take: a block before them runs on meta, its output zeros
                    with torch.no_grad(), _on_meta(self.blocks[k]):
                        out = original(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
                    device = active.parts[0].device
                    return map_tensors(out, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device))
                shape = self._bare_shape.get(k)
                if isinstance(received, Tensor) and shape is not None and (k == active.start - 1 or shape == received.shape):
                    # a block seen to return one bare tensor: the received activation stands in for its output
                    # without running it on meta (that costs ~1 ms of dispatch per block and micro-batch)
                    return received
                if k == active.start - 1 and self.structures.get(k) is not None:
                    return _fill(self.structures[k], received, self.names[k])
                handed = self.structures.get(active.start - 1)
                if handed is not None and type(self.blocks[k]) is type(self.blocks[active.start - 1]):
                    # an earlier block of the stack's class: zeros in the structure the handing block has, never a run on
                    # meta (a kernel may refuse meta tensors: MoE grouped_mm); block start - 1 replaces them anyway
                    return _fill(handed, map_tensors(received, torch.zeros_like), self.names[k])
                with torch.no_grad(), _on_meta(self.blocks[k]):
                    out = original(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
                if isinstance(out, Tensor):
                    self._bare_shape[k] = out.shape
                if k == active.start - 1:
                    return _stand_in(out, received, self.names[k])
                device = _tensors(received)[0].device
                return map_tensors(out, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device))
            cache = cache_argument(args, kwargs)
            if cache is not None:
                value = kwargs[cache] if cache in kwargs else args[int(cache[5:-1])]
                raise ValueError(describe_cache_refusal(
                    "pipeline", self.names[k], self.blocks[k], cache, value,
                    "each micro-batch and stage runs the block on its own part of the batch, and a recomputation",
                ))
            if k >= active.end:
                raise RuntimeError(f"block {self.names[k]!r} ran after the last block of its stage; the stage should have stopped")
            if k == active.start and active.mark is not None:
                args, kwargs = _mark_first(args, kwargs, active.mark)
            if active.remat and torch.is_grad_enabled():
                out = torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)
            else:
                out = original(*args, **kwargs)
            if k in self.stack_ends and not active.last:  # a stack's end: a later stage may need it (stack_carry)
                if k not in self.structures:
                    self.structures[k] = self._carriable(k, out)
                active.produced[k] = _hidden(out, self.names[k])
            if k == active.end - 1 and not active.last:
                if k not in self.structures:
                    self.structures[k] = _structure(out)
                raise _StageOutput(_hidden(out, self.names[k]))
            return out

        return forward


def _mark_first(args: tuple, kwargs: dict, mark: Callable[[Tensor], Tensor]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with ``mark`` applied to the first tensor among them that requires grad."""
    done = [False]

    def once(t: Tensor) -> Tensor:
        if done[0] or not t.requires_grad:
            return t
        done[0] = True
        return mark(t)

    args = map_tensors(args, once)
    return args, map_tensors(kwargs, once)


@contextmanager
def _on_meta(module: nn.Module) -> Iterator[None]:
    """``module`` with meta stand-ins for its tensors that have storage (a block this rank holds for another of its
    stages, run here for shapes only), its own tensors back afterwards."""
    swapped: list[tuple[nn.Module, str, bool, Tensor]] = []
    for m in module.modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in list(table.items()):
                if t is not None and not t.is_meta:
                    swapped.append((m, name, is_param, t))
                    meta = t.detach().to("meta")
                    table[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta
    try:
        yield
    finally:
        for m, name, is_param, t in swapped:
            (m._parameters if is_param else m._buffers)[name] = t


def _to_meta(t: Tensor) -> Tensor:
    return t.detach().to("meta")
