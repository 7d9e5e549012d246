"""``torch.compile`` under the pipeline strategies. ``gpipe_distributed`` refuses, before any work and in one line, a compile
around the blocks in each of the three ways a Lightning user compiles (before: the fit ran, Dynamo compiled no graph, and
the weights ended 0.288 from DDP's); a compiled block is run (its stage runs it whole: the regression rows'
``llama-compiled`` trains like plain Lightning in tests/strategies/test_gpipe_distributed_real_models.py)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled

from lightning_accel import DistributedGPipeStrategy
from tests.support.conformance.task import Task

REFUSED = (r"^DistributedGPipeStrategy cannot run {}: it holds the pipeline's blocks, which each rank runs with the other "
           r"ranks' as sends and receives, and Dynamo cannot trace that; compile each block instead \(block.compile\(\)\), "
           r"or remove torch.compile$")


def _compiled_net() -> Task:
    task = Task()
    task.net = torch.compile(task.net)  # what configure_model or __init__ does: an OptimizedModule holding the blocks
    return task


def _compiled_in_place() -> Task:
    task = Task()
    task.net.compile()
    return task


@pytest.mark.parametrize(("build", "said"), [
    (_compiled_net, r"net = torch.compile\(net\)"),
    (_compiled_in_place, r"net.compile\(\)"),
    (lambda: from_compiled(torch.compile(Task())), r"trainer.fit\(torch.compile\(Task\(...\)\)\)"),  # as Lightning unwraps it
])
def test_a_compile_around_the_blocks_is_refused_before_any_work(build, said) -> None:
    with pytest.raises(ValueError, match=REFUSED.format(said)):
        DistributedGPipeStrategy(chunks=2).refuse_compiled(build())


def test_compiled_blocks_are_run() -> None:
    task = Task()
    for block in task.net.blocks:
        block.compile()
    DistributedGPipeStrategy(chunks=2).refuse_compiled(task)  # nothing to refuse
