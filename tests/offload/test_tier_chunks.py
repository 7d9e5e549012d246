"""The host step's chunks of a unit: every element of every tensor once, at most the limit a chunk, ranges aligned for
O_DIRECT and at the grain the optimizer's kernels step by, adjacent ranges one request."""

from __future__ import annotations

import pytest

from lightning_accel.offload.tier_chunks import ALIGN, GRAIN, Strand, cut_unit


def _unit(numels: list[int], itemsizes: tuple[int, ...] = (2, 4, 4, 4)) -> list[tuple[int, list[Strand]]]:
    """Parameters laid out as the tier lays out a unit: each kind's tensors one after another (shadows, masters, then
    each parameter's state tensors), each region aligned."""
    at = 0
    strands: list[list[Strand]] = [[] for _ in numels]
    kinds = [(k, size) for k, size in enumerate(itemsizes)]
    for kind, size in kinds[:2]:  # shadows, then masters
        for i, numel in enumerate(numels):
            strands[i].append(Strand((kind, i), at, size))
            at += -(-numel * size // ALIGN) * ALIGN
    for i, numel in enumerate(numels):  # each parameter's state tensors together
        for kind, size in kinds[2:]:
            strands[i].append(Strand((kind, i), at, size))
            at += -(-numel * size // ALIGN) * ALIGN
    return [(numel, s) for numel, s in zip(numels, strands)]


def _covered(chunks: list, params: list) -> dict[object, list[tuple[int, int]]]:
    ranges: dict[object, list[tuple[int, int]]] = {}
    for chunk in chunks:
        for piece in chunk.pieces:
            for strand in params[piece.param][1]:
                ranges.setdefault(strand.key, []).append((piece.start, piece.stop))
    return ranges


def test_a_unit_under_the_limit_is_one_chunk_read_in_one_request() -> None:
    params = _unit([128, 4096 * 3, 7])  # a bias, a matrix, a scale: 14 B an element, each tensor rounded to 4 KiB
    (chunk,) = cut_unit(params, 1 << 20)
    assert [(p.param, p.start, p.stop) for p in chunk.pieces] == [(0, 0, 128), (1, 0, 12288), (2, 0, 7)]
    # the unit's whole span, contiguous in the file: one request (split into 4 MiB ones by the I/O threads)
    assert chunk.spans == ((0, 0, chunk.nbytes),)
    assert chunk.nbytes == sum(-(-n * s.itemsize // ALIGN) * ALIGN for n, strands in params for s in strands)


def test_a_parameter_larger_than_the_limit_is_cut_at_the_grain_and_every_element_is_stepped_once() -> None:
    numels = [100, 5 * GRAIN + 37, 3 * GRAIN, 9]
    params = _unit(numels)
    limit = 2 * GRAIN * 14 + 4 * ALIGN  # two grains of a matrix and a little more
    chunks = cut_unit(params, limit)
    assert len(chunks) == 4 and all(c.nbytes <= limit for c in chunks)
    for key, ranges in _covered(chunks, params).items():
        numel = numels[key[1]]
        assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(sorted(ranges), sorted(ranges)[1:])), key  # no gap, no overlap
        assert all(start % GRAIN == 0 for start, _ in ranges)  # where the optimizer's vector loop starts
    for chunk in chunks:
        assert all(offset % ALIGN == 0 and at % ALIGN == 0 and n % ALIGN == 0 for offset, at, n in chunk.spans)
        for piece in chunk.pieces:  # each range where its tensor's offset says, in the chunk's buffer
            for strand in params[piece.param][1]:
                at = piece.at[strand.key]
                file_offset = strand.offset + piece.start * strand.itemsize
                assert any(o <= file_offset and file_offset - o == at - b and at + (piece.stop - piece.start) * strand.itemsize <= b + n
                           for o, b, n in chunk.spans)


def test_parameters_with_nothing_on_disk_ride_along_and_a_limit_below_one_grain_is_refused() -> None:
    chunks = cut_unit([(10, []), *(_unit([GRAIN]))], 1 << 20)
    assert [(p.param, p.start, p.stop) for p in chunks[0].pieces] == [(0, 0, 10), (1, 0, GRAIN)]
    with pytest.raises(ValueError, match=r"a step buffer of 40,960 bytes cannot hold 4096 elements of a parameter \(14 bytes an "
                                         r"element on disk\); raise strategy.nvme_chunk"):
        cut_unit(_unit([2 * GRAIN]), 10 * ALIGN)
