from collections import namedtuple

import pytest
import torch

from lightning_accel.pipeline.microbatch import batch_size, gather, scatter

Pair = namedtuple("Pair", "x y")


def test_scatter_tensor_sizes_follow_tensor_split():
    x = torch.arange(10)
    parts = scatter(x, 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert torch.equal(gather(parts), x)


def test_scatter_nested_keeps_structure_and_alignment():
    batch = {"x": torch.arange(6).view(6, 1), "pair": (torch.arange(6) * 10, [torch.arange(6) * 100]), "tag": "t"}
    parts = scatter(batch, 3)
    assert len(parts) == 3
    for i, p in enumerate(parts):
        assert set(p) == {"x", "pair", "tag"} and p["tag"] == "t"
        assert isinstance(p["pair"], tuple) and isinstance(p["pair"][1], list)
        assert p["x"].flatten().tolist() == [2 * i, 2 * i + 1]
        assert (p["pair"][0] // 10).tolist() == p["x"].flatten().tolist()
        assert (p["pair"][1][0] // 100).tolist() == p["x"].flatten().tolist()
    back = gather(parts)
    assert torch.equal(back["x"], batch["x"]) and torch.equal(back["pair"][1][0], batch["pair"][1][0])


def test_scatter_namedtuple():
    parts = scatter(Pair(torch.zeros(4, 2), torch.ones(4)), 2)
    assert all(isinstance(p, Pair) and p.x.shape == (2, 2) for p in parts)
    assert isinstance(gather(parts), Pair)


def test_chunks_greater_than_batch_size_is_an_error():
    with pytest.raises(ValueError, match=r"chunks=5 is greater than the batch size 4.*set chunks <= 4"):
        scatter((torch.zeros(4, 3), torch.zeros(4)), 5)


@pytest.mark.parametrize("chunks", [0, -1, 2.0])
def test_chunks_must_be_positive_int(chunks):
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        scatter(torch.zeros(4), chunks)


def test_mismatched_batch_dimensions_are_an_error():
    with pytest.raises(ValueError, match=r"different sizes in dimension 0 \(\[3, 4\]\)"):
        batch_size((torch.zeros(4), torch.zeros(3)))


def test_batch_without_tensors_is_an_error():
    with pytest.raises(ValueError, match="holds no tensor"):
        scatter(["a", "b"], 2)
