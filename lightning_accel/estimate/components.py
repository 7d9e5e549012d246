"""Each rank's device and host bytes by component, per strategy: the arithmetic, in one place.

The inputs are plain data: what the model holds (:class:`~.params.Inventory`, optimizer state
measured), what a step's activations take (:class:`~.activations.StepActivations`, measured at
the micro-batch the strategy runs) and the strategy's settings (:class:`Plan`). The rules are
the strategies' own:

- plain / DDP (and XLA): parameters, gradients and optimizer state on every device in the
  parameters' dtype; a frozen base as stored; DDP's gradient buckets are one more copy of the
  gradients (Lightning's ``gradient_as_bucket_view=False``); XLA's SPMD data parallel is one
  process whose devices each hold the model and the activations of their shard of the batch;
- L2L offload (:class:`~lightning_accel.offload.host_store.HostStore`): the host keeps fp32
  masters, a low-precision shadow of each trainable matrix when the device computes in
  bf16/fp16, fp32 gradients, frozen weights as stored, on CUDA the pinned rings the copies cross
  (:mod:`~lightning_accel.offload.staging`: a few slots of one chunk each), the optimizer state and, with ``delayed_update``, a
  shadow of every fp32 parameter too; the device holds ``prefetch_blocks + 1`` blocks, the
  resident unit (fp32 with its gradients and optimizer state, or streamed in the compute dtype
  with ``offload_resident``) and the activations; ``l2l_offload_ddp`` partitions the optimizer
  state by block over the ranks (:func:`~lightning_accel.offload.partition.partition_units`);
  with ``host_budget`` / ``nvme_path`` the NVMe tier's plan (:mod:`.tier`: the strategy's own) moves
  the spilled blocks' optimizer state and fp32 masters from the host to the disk, as laid out in its
  files, and adds its reusable I/O buffers to the host;
- GPipe, per stage: its blocks' parameters, gradients and optimizer state (the first stage
  also the embeddings, the last the head); activations per micro-batch times the micro-batches
  in flight (GPipe: all ``chunks``; 1F1B: ``stages - s`` on stage ``s``), a re-materialized one
  keeping only its stage input (``gpipe``) or its blocks' inputs (``gpipe_distributed``) and
  what is outside the blocks (embedding, head, loss), plus one micro-batch's backward;
  ``gpipe_distributed`` also keeps the weights outside the blocks on every rank (gradients and
  state only where used), torch's per-micro-batch receive buffers and, while the schedule runs
  backward inside ``training_step``, the last step's gradients (and for the encoder's output that
  an encoder-decoder's stages carry beside their own, its receive buffers too: every stack is pipelined,
  as the strategy does); ``gpipe`` on the CPU is
  one process whose stages share the memory and run one micro-batch's backward at a time.

Nothing here imports Lightning or allocates a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_accel.estimate.activations import StepActivations
from lightning_accel.estimate.params import Inventory, Tensors
from lightning_accel.offload.tier_plan import COPY_SLOTS, DEFAULT_CHUNK, GRAD_SLOTS, TierPlan
from lightning_accel.pipeline.stack_carry import carried_into, carried_out_of

FP32 = 4

# strategy kinds the estimate knows
PLAIN, DDP, L2L, L2L_DDP, GPIPE, GPIPE_DIST = "plain", "ddp", "l2l_offload", "l2l_offload_ddp", "gpipe", "gpipe_distributed"
XLA_SPMD = "xla_spmd"  # one process, the batch sharded over ``world`` XLA devices, the model replicated on each
KINDS = (PLAIN, DDP, XLA_SPMD, L2L, L2L_DDP, GPIPE, GPIPE_DIST)


@dataclass(frozen=True)
class Plan:
    """A strategy's settings, as the estimate needs them (decided once from the recipe)."""

    strategy: str
    world: int = 1  # processes (xla_spmd: devices of the one process)
    on_cpu: bool = False  # the device is the host: device bytes are host bytes
    param_size: int = FP32  # bytes an element of the trainable parameters on the device (plain, GPipe)
    compute_size: int = FP32  # bytes an element of L2L's device copies of matrices
    pin: bool = False  # page-locked host buffers (CUDA)
    prefetch_blocks: int = 1
    offload_resident: bool = False
    checkpoint_blocks: bool = True
    offload_activations: bool = False
    delayed_update: bool = False
    partitioned: bool = True  # l2l_offload_ddp's host_step
    chunks: int = 1
    schedule: str = "gpipe"
    checkpoint: str = "never"  # pipeline: always | except_last | never
    balance: tuple[int, ...] = ()  # blocks per stage, in stage order
    stack_ends: tuple[int, ...] = ()  # gpipe_distributed: blocks ending a stack, their outputs carried on (stack_carry)
    stages_per_rank: int = 1
    loader_bytes: int = 0  # bytes of the batches a rank's loader holds at once
    step_scratch: int = 0  # the most bytes the optimizer step creates and frees, all trainable parameters (measured)
    tier: TierPlan | None = None  # l2l_offload(_ddp) with host_budget / nvme_path: the NVMe tier's plan (one rank's; estimate/tier.py)
    notes: tuple[str, ...] = ()


@dataclass
class RankEstimate:
    """One kind of rank (every rank of DDP; each pipeline stage): bytes by component."""

    kind: str
    count: int
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)  # the NVMe tier's files

    @property
    def device_peak_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())


def _put(target: dict[str, int], name: str, value: int) -> None:
    if value:
        target[name] = target.get(name, 0) + int(value)


def _loader(plan: Plan, host: dict[str, int]) -> None:
    _put(host, "loader batches (workers x prefetch)", plan.loader_bytes)


def _on_cpu(plan: Plan, rank: RankEstimate) -> RankEstimate:
    """On the CPU the device is the host: every device component moves to the host column."""
    if plan.on_cpu:
        host, rank.host = rank.host, dict(rank.device)
        for name, value in host.items():
            _put(rank.host, name, value)
        rank.device = {}
    return rank


def plain(inv: Inventory, acts: StepActivations, plan: Plan) -> list[RankEstimate]:
    """Plain and DDP: every rank the same; XLA SPMD: every device the same (activations of its shard of the batch,
    measured at that size) and the one process's loader on the host."""
    total = inv.total
    spmd = plan.strategy == XLA_SPMD
    rank = RankEstimate("device" if plan.world == 1 else "xla device" if spmd else "rank", plan.world)
    _put(rank.device, "parameters", total.trainable * plan.param_size)
    _put(rank.device, "frozen/quantized weights", total.frozen_bytes)
    _put(rank.device, "buffers", total.buffer_bytes)
    _put(rank.device, "gradients", total.trainable * plan.param_size)
    if plan.strategy == DDP and plan.world > 1:
        _put(rank.device, "DDP gradient buckets", total.trainable * plan.param_size)
    _put(rank.device, "optimizer state", total.optimizer_bytes)
    _put(rank.device, "activations", acts.peak)
    _step_scratch(rank, plan.step_scratch, acts.peak)
    if spmd and plan.world > 1:  # one process loads the whole batch
        host = RankEstimate("host process", 1)
        _loader(plan, host.host)
        return [rank, host]
    _loader(plan, rank.host)
    return [_on_cpu(plan, rank)]


def _step_scratch(rank: RankEstimate, scratch: int, activations: int) -> None:
    """The optimizer step runs once the activations are freed: its scratch adds only what exceeds them."""
    _put(rank.device, "optimizer step scratch (beyond the activations)", max(scratch - activations, 0))


PINNED = "pinned staging (copy rings)"


def _crossing(unit: Tensors, plan: Plan) -> int:
    """A unit's bytes crossing the bus (its largest parameter is at most that: the bound on a ring's slot)."""
    return unit.matrices * plan.compute_size + (unit.trainable - unit.matrices) * FP32 + unit.frozen_bytes


def _l2l_host(offloaded: Tensors, plan: Plan, host: dict[str, int], optimizer_bytes: int, units: list[Tensors]) -> None:
    low = plan.compute_size != FP32 and not plan.on_cpu  # shadows only where the device computes in bf16/fp16
    _put(host, "masters (fp32)", offloaded.trainable * FP32)
    if low:
        _put(host, "low-precision shadows", offloaded.matrices * plan.compute_size)
    if plan.delayed_update:  # every parameter without a shadow of its own gets one
        _put(host, "delayed-update copies", (offloaded.trainable - (offloaded.matrices if low else 0)) * FP32)
    _put(host, "gradients (fp32)", offloaded.trainable * FP32)
    _put(host, "frozen/quantized weights", offloaded.frozen_bytes)
    _put(host, "buffers", offloaded.buffer_bytes)
    if plan.pin and not plan.on_cpu:  # the copies cross pinned rings of a few slots (offload/staging.py); the tier's plan sizes them
        _put(host, PINNED, (GRAD_SLOTS + COPY_SLOTS) * min(DEFAULT_CHUNK, max((_crossing(u, plan) for u in units), default=0)))
    _put(host, "optimizer state", optimizer_bytes)


def _tier(tier: TierPlan, blocks: list[Tensors], rank: RankEstimate) -> None:
    """The spilled blocks' fp32 masters and optimizer state leave the host for the disk (there as laid out in the
    tier's files, each tensor aligned); the tier's I/O buffers join the host; where every step runs during the backward
    the gradients held at once are the plan's (a few blocks', the backward held back beyond them). ``blocks``: the
    tier's units, the blocks then a streamed resident unit."""
    if len(tier.units) != len(blocks):
        raise ValueError(f"the NVMe tier's plan has {len(tier.units)} units for {len(blocks)} blocks; both come from the "
                         "strategy's block policy, so this is a bug in the estimate")
    if tier.grads_in_flight is not None and "gradients (fp32)" in rank.host:
        rank.host["gradients (fp32)"] = tier.grad_bytes
    n = range(len(blocks))
    for name, on_disk, host_bytes, disk_bytes in (
        ("masters (fp32)", tier.masters_on_disk, [b.trainable * FP32 for b in blocks], [u.masters for u in tier.units]),
        # (a unit without state in the plan: another rank's, partitioned; this rank holds none of it)
        ("optimizer state", tier.state_on_disk, [b.optimizer_bytes * bool(u.state) for b, u in zip(blocks, tier.units)],
         [u.state for u in tier.units]),
    ):
        left = rank.host.get(name, 0) - sum(host_bytes[i] for i in n if on_disk[i])
        if left > 0:
            rank.host[name] = left
        else:
            rank.host.pop(name, None)
        _put(rank.disk, name, sum(disk_bytes[i] for i in n if on_disk[i]))
    # weights on disk (shadows first, then frozen weights as stored; quantized ones never go): the host loses them as laid
    # out, each tensor rounded up to 4 KiB (a few kB a tensor more than they held)
    moved = sum(tier.units[i].disk_weights for i in n if tier.spilled_weights(i))
    for name in ("low-precision shadows", "frozen/quantized weights"):
        take = min(moved, rank.host.get(name, 0))
        if take:
            left = rank.host[name] - take
            if left > 0:
                rank.host[name] = left
            else:
                rank.host.pop(name)
            moved -= take
    _put(rank.disk, "weights", sum(tier.units[i].disk_weights for i in n if tier.spilled_weights(i)))
    if tier.spills:
        _put(rank.host, "NVMe tier I/O buffers", tier.buffer_bytes)
    if PINNED in rank.host:  # the plan's rings: slots of its chunk, or of the largest parameter crossing the bus
        rank.host[PINNED] = tier.staging_bytes


def l2l(inv: Inventory, acts: StepActivations, plan: Plan) -> list[RankEstimate]:
    from lightning_accel.offload.partition import partition_units

    units = list(inv.blocks) + ([inv.rest] if plan.offload_resident else [])
    offloaded = sum(units, Tensors())
    state = offloaded.optimizer_bytes
    if plan.strategy == L2L_DDP and plan.partitioned and plan.world > 1:
        owners = partition_units([u.trainable for u in units], plan.world)
        state = max(sum(units[i].optimizer_bytes for i in owners.owned(r)) for r in range(plan.world))
    rank = RankEstimate("rank" if plan.world > 1 else "device", plan.world)
    _l2l_host(offloaded, plan, rank.host, state, units)
    if plan.tier is not None:
        _tier(plan.tier, units, rank)
    alias = plan.on_cpu and plan.compute_size == FP32  # blocks compute on their host masters: no copies
    if not alias:
        biggest = max(b.weight_bytes(FP32, plan.compute_size) for b in inv.blocks)
        _put(rank.device, f"blocks in flight ({plan.prefetch_blocks + 1})", (plan.prefetch_blocks + 1) * biggest)
    rest = inv.rest
    if plan.offload_resident:
        if not alias:
            _put(rank.device, "resident unit streamed in", rest.weight_bytes(FP32, plan.compute_size))
            _put(rank.device, "resident gradients", rest.matrices * plan.compute_size + (rest.trainable - rest.matrices) * FP32)
    else:
        _put(rank.device, "resident parameters", rest.weight_bytes(FP32))  # trainable in fp32, frozen as stored
        _put(rank.device, "resident gradients", rest.trainable * FP32)
        _put(rank.device, "resident optimizer state", rest.optimizer_bytes)
    activations = acts.peak
    if plan.offload_activations:  # block inputs wait on the host; two on the device (one arriving, one used)
        parked = sum(acts.inputs)
        _put(rank.host, "parked block inputs", parked)
        activations = max(activations - parked + 2 * max(acts.inputs, default=0), 0)
    _put(rank.device, "activations (incl. one block's gradients)", activations)
    _loader(plan, rank.host)
    return [_on_cpu(plan, rank)]


def _in_flight(plan: Plan, stage: int, stages: int) -> int:
    if plan.schedule == "1f1b":
        return min(plan.chunks, stages - stage)
    return plan.chunks  # gpipe; interleaved 1F1B counted as GPipe (an upper bound)


def _stage_activations(acts: StepActivations, blocks: range, first: bool, last: bool, plan: Plan, stage: int, stages: int) -> tuple[int, int]:
    """``(kept, working)``: the bytes a stage's micro-batches in flight keep, and the most one micro-batch's
    backward adds on top of them (a re-materialized one's recompute and the gradients' transient).

    What is outside the blocks (the embedding's output on the first stage, the head and the loss on the last) is
    never re-materialized. A re-materialized micro-batch keeps, under ``gpipe``, its stage's input (the stage's
    blocks run in one checkpoint) and, under ``gpipe_distributed``, each block's input (a checkpoint per block,
    recomputed one block at a time)."""
    outside = (acts.before if first else 0) + (acts.after if last else 0)
    kept = [acts.kept[i] for i in blocks]
    full = sum(kept) + outside
    inputs = [acts.inputs[i] for i in blocks if not (first and i == blocks.start)]  # the first stage's input is in `before`
    if plan.strategy == GPIPE:
        light, recompute = (inputs[0] if inputs and not first else 0) + outside, sum(kept)
    else:
        light, recompute = sum(inputs) + outside, max(kept, default=0)
    transient = max([acts.backward[i] for i in blocks] + ([acts.head_backward] if last else []))
    m = _in_flight(plan, stage, stages)
    if plan.checkpoint == "always":
        return m * light, recompute + transient
    if plan.checkpoint == "except_last" and plan.chunks > 1:
        # the step's last micro-batch is kept whole; it is not alive while an earlier one is recomputed
        return max(((m - 1) * light + full, transient), (m * light, recompute + transient), key=sum)
    return m * full, transient


def pipeline(inv: Inventory, acts: StepActivations, plan: Plan) -> list[RankEstimate]:
    """One row per pipeline rank (``gpipe_distributed``: ``count`` replicas of it; ``gpipe``: its stage device), or,
    for ``gpipe`` on the CPU, one row for the process whose memory every stage shares."""
    stages = len(plan.balance)
    ranks = stages // plan.stages_per_rank
    replicas = max(plan.world // ranks, 1) if plan.strategy == GPIPE_DIST else 1
    starts = [sum(plan.balance[:s]) for s in range(stages)]
    what = f"activations ({plan.chunks} micro-batches, {plan.schedule}, checkpoint {plan.checkpoint})"
    one_memory = plan.strategy == GPIPE and plan.on_cpu  # one process, its stages on the same device
    out, every_part = [], []
    for r in range(ranks):
        own = list(range(r, stages, ranks))
        name = f"stage {r}" if plan.stages_per_rank == 1 else f"rank {r} (stages {', '.join(str(s) for s in own)})"
        rank = RankEstimate(name, replicas)
        held, parts = Tensors(), []
        for s in own:
            blocks = range(starts[s], starts[s] + plan.balance[s])
            first, last = s == 0, s == stages - 1
            held = sum((inv.blocks[i] for i in blocks), held + (inv.before if first else Tensors()) + (inv.after if last else Tensors()))
            parts.append(_stage_activations(acts, blocks, first, last, plan, s, stages))
        every_part += parts
        _put(rank.device, "parameters", held.trainable * plan.param_size)
        _put(rank.device, "frozen/quantized weights", held.frozen_bytes)
        _put(rank.device, "buffers", held.buffer_bytes)
        if plan.strategy == GPIPE_DIST:
            # what is outside the blocks stays on every rank (a later rank still runs the embedding); only the
            # ranks that use a parameter get its gradient and step it
            unused = (inv.before if 0 not in own else Tensors()) + (inv.after if stages - 1 not in own else Tensors())
            _put(rank.device, "weights outside the blocks, unused here", unused.weight_bytes(plan.param_size))
        _put(rank.device, "gradients", held.trainable * plan.param_size)
        if plan.strategy == GPIPE_DIST:
            # the schedule runs backward inside training_step, and Lightning zeroes the last step's gradients only
            # after it: they are set aside (pipeline.gradients.set_aside), alive beside the new ones
            _put(rank.device, "last step's gradients (zeroed after training_step)", held.trainable * plan.param_size)
        _put(rank.device, "optimizer state", held.optimizer_bytes)
        _put(rank.device, what, sum(k for k, _ in parts) + max(w for _, w in parts))
        if plan.strategy == GPIPE_DIST:
            # torch's pipeline stage allocates a receive buffer per micro-batch for its input (not the first stage)
            # and for its output's gradient (not the last), kept from the first step on
            boundary = sum(acts.inputs[starts[s]] for s in own if s > 0) + sum(acts.inputs[starts[s + 1]] for s in own if s < stages - 1)
            # and for the stack ends carried beside them (an encoder's output, the size of its last block's input)
            boundary += sum(acts.inputs[k] for s in own for k in carried_into(plan.stack_ends, starts, s))
            boundary += sum(acts.inputs[k] for s in own for k in carried_out_of(plan.stack_ends, starts, s))
            _put(rank.device, f"receive buffers ({plan.chunks} micro-batches)", plan.chunks * boundary)
        share = held.trainable / max(inv.total.trainable, 1)  # the stage's parameters step on its device
        _step_scratch(rank, int(plan.step_scratch * share), rank.device.get(what, 0))
        if plan.strategy == GPIPE_DIST or r == 0:  # every process loads the batch; gpipe is one process
            _loader(plan, rank.host)
        out.append(rank)
    if one_memory and len(out) > 1:
        out = [_one_process(out, every_part, what, plan.step_scratch)]
    return [_on_cpu(plan, rank) for rank in out]


def _one_process(stages: list[RankEstimate], parts: list[tuple[int, int]], what: str, step_scratch: int) -> RankEstimate:
    """The stages of a one-process pipeline whose devices are one memory (the CPU): every stage's parameters, state and
    kept activations together, and one micro-batch's backward at a time (the micro-batches run one after another)."""
    rank = RankEstimate(f"process (stages 0-{len(stages) - 1})", 1)
    for stage in stages:
        for name, value in stage.device.items():
            if name != what and not name.startswith("optimizer step scratch"):
                _put(rank.device, name, value)
        for name, value in stage.host.items():
            _put(rank.host, name, value)
    _put(rank.device, what, sum(k for k, _ in parts) + max(w for _, w in parts))
    _step_scratch(rank, step_scratch, rank.device.get(what, 0))
    return rank


def estimate_ranks(inv: Inventory, acts: StepActivations, plan: Plan) -> list[RankEstimate]:
    """The rank kinds of ``plan``'s strategy with their bytes by component."""
    if plan.strategy in (PLAIN, DDP, XLA_SPMD):
        return plain(inv, acts, plan)
    if plan.strategy in (L2L, L2L_DDP):
        return l2l(inv, acts, plan)
    if plan.strategy in (GPIPE, GPIPE_DIST):
        return pipeline(inv, acts, plan)
    raise ValueError(f"no estimate for strategy kind {plan.strategy!r}; one of {', '.join(KINDS)}")
