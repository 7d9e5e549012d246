"""Sub-unit chunks of the NVMe tier's host step: which element ranges of which tensors each step buffer holds.

A unit's host step reads, steps and writes back its span of the file (:mod:`.tier`): each trainable parameter's
shadow, master and optimizer state where they are on disk. A unit can be far larger than a buffer the host may
keep (a block of a 175B model: ~1.8B parameters, ~25 GB of state, masters and shadows; a 128k-vocabulary
embedding), so the span is cut into *chunks* of at most the plan's chunk size (:attr:`~.tier_plan.TierPlan.step_buffer`):
runs of whole parameters, and a parameter larger than what is left of a chunk cut into element ranges. A range
of a parameter covers the same elements of each of its tensors (shadow, master, each state tensor), so the
optimizer's per-element rule steps the range on its own (:mod:`.slice_step`).

Ranges start at multiples of :data:`GRAIN` elements (4096): every tensor's range then starts on a 4096-byte
boundary of its region, as ``O_DIRECT`` asks, and at a multiple of every vector width torch's CPU kernels step
by (their parallel split is in cache lines from a tensor's start; their scalar remainder loop runs only at a
tensor's end), so a range is stepped with the same float operations as it is inside the whole tensor: the chunked
step equals the whole one bit for bit (checked for every per-parameter optimizer, fused and not:
tests/offload/test_slice_step.py). Within a chunk the tensors' ranges are packed in file order and adjacent ones
merged into one request. A pure function of offsets and sizes; nothing here imports torch or Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4096  # (disk_io.ALIGN: O_DIRECT's alignment; repeated to keep this module free of torch)
GRAIN = 4096  # elements: where a range of a parameter may start


def _align_up(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Strand:
    """One tensor of a parameter in the unit's file: its region's key, the file offset of its element 0, and
    its element size."""

    key: object
    offset: int
    itemsize: int


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of parameter ``param`` (its index in the unit's list); ``at``: each strand key -> the
    buffer offset of the range (strands not on disk are not in it)."""

    param: int
    start: int
    stop: int
    at: dict[object, int]


@dataclass(frozen=True)
class Chunk:
    """What one step buffer holds: its pieces, and the requests that read and write it (file offset, buffer offset,
    bytes; each aligned)."""

    pieces: tuple[Piece, ...]
    spans: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.spans)


def cut_unit(params: list[tuple[int, list[Strand]]], limit: int) -> list[Chunk]:
    """The chunks of a unit whose trainable parameters are ``params`` (numel, strands on disk; in step order), none
    of more than ``limit`` buffer bytes. A parameter with no strand on disk (its state and master in memory) rides in
    the chunk it falls in. Raises ValueError when ``limit`` cannot hold :data:`GRAIN` elements of a parameter."""
    chunks: list[Chunk] = []
    pieces: list[tuple[int, int, int]] = []  # (param, start, stop)
    used = 0

    def close() -> None:
        nonlocal used
        if pieces:
            chunks.append(_packed(pieces, params))
            pieces.clear()
        used = 0

    for index, (numel, strands) in enumerate(params):
        start = 0
        per_element = sum(s.itemsize for s in strands)
        while start < numel or (numel == 0 and start == 0):
            rest = numel - start
            whole = sum(_align_up(rest * s.itemsize) for s in strands)
            if used + whole <= limit:
                count = rest
            else:
                count = (limit - used) // (per_element * GRAIN) * GRAIN
                if count == 0:
                    if not pieces:
                        raise ValueError(f"a step buffer of {limit:,} bytes cannot hold {GRAIN} elements of a parameter "
                                         f"({per_element} bytes an element on disk); raise strategy.nvme_chunk")
                    close()
                    continue
            pieces.append((index, start, start + count))
            used += sum(_align_up(count * s.itemsize) for s in strands)
            start += count
            if numel == 0:
                break
            if start < numel:  # the chunk is full
                close()
    close()
    return chunks


def _packed(pieces: list[tuple[int, int, int]], params: list[tuple[int, list[Strand]]]) -> Chunk:
    """The chunk of ``pieces``: their tensors' ranges packed into the buffer in file order, adjacent ones merged."""
    ranges = sorted((s.offset + start * s.itemsize, _align_up((stop - start) * s.itemsize), n, s.key)
                    for n, (index, start, stop) in enumerate(pieces) for s in params[index][1] if stop > start)
    at: list[dict[object, int]] = [{} for _ in pieces]
    spans: list[list[int]] = []
    cursor = 0
    for offset, nbytes, n, key in ranges:
        at[n][key] = cursor
        if spans and spans[-1][0] + spans[-1][2] == offset:
            spans[-1][2] += nbytes
        else:
            spans.append([offset, cursor, nbytes])
        cursor += nbytes
    return Chunk(tuple(Piece(index, start, stop, at[n]) for n, (index, start, stop) in enumerate(pieces)),
                 tuple((o, b, n) for o, b, n in spans))
