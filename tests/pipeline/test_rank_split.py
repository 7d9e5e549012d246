"""An optimizer's param groups on a split module follow what callbacks add (:meth:`RankSplit.follow_param_groups`)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_accel.pipeline.placement import RankLayout, owners
from lightning_accel.pipeline.rank_split import RankSplit, tensors_of


def _split(rank: int) -> tuple[nn.Sequential, RankSplit, RankLayout, torch.optim.Optimizer]:
    """Three Linear blocks over 2 ranks ([1, 2]); ``net.0`` frozen, the optimizer built over the rest, as
    BaseFinetuning's users build it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    net[0].requires_grad_(False)
    owned, shared = owners(tensors_of(net), list(net), [1, 2], 2)
    split = RankSplit(owned, shared, set())
    layout = RankLayout(rank, 0, 2, 1, None, None, torch.device("cpu"))
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    split.keep_own_parameters(net, [optimizer], layout)
    return net, split, layout, optimizer


def test_a_group_added_mid_training_keeps_this_ranks_share_under_the_whole_models_indices():
    """BaseFinetuning unfreezes ``net.0`` (rank 0's) with ``add_param_group``: rank 0 keeps it as group 1 (indices 4, 5
    of the whole model's optimizer), rank 1 an empty group 1; the group as the whole model holds it stays on record
    (what the callback saves by name), and nothing changes when called again."""
    for rank, kept, group_sizes in ((0, [4, 5], [0, 2]), (1, [0, 1, 2, 3], [4, 0])):
        net, split, layout, optimizer = _split(rank)
        net[0].requires_grad_(True)
        optimizer.add_param_group({"params": list(net[0].parameters()), "lr": 0.01})
        for _ in range(2):
            split.follow_param_groups([optimizer], layout)
            assert [len(g["params"]) for g in optimizer.param_groups] == group_sizes
            assert split.optimizer_index[0] == ([[0, 1, 2, 3], [4, 5]], kept)
        whole = split.whole_param_groups(0, optimizer)
        assert [p for p in whole[1]["params"]] == list(net[0].parameters()) and whole[1]["lr"] == 0.01


def test_groups_replaced_whole_are_split_again():
    """BaseFinetuning's resume puts back every group by name, every parameter in it: taken whole, as at the split."""
    net, split, layout, optimizer = _split(1)
    params = list(net.parameters())
    optimizer.param_groups = [{**optimizer.param_groups[0], "params": params[2:]}, {**optimizer.param_groups[0], "params": params[:2]}]
    split.follow_param_groups([optimizer], layout)
    assert [len(g["params"]) for g in optimizer.param_groups] == [4, 0]
    assert split.optimizer_index[0] == ([[0, 1, 2, 3], [4, 5]], [0, 1, 2, 3])
