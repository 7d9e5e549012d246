"""The multi-process pipeline on 2 gloo ranks against plain training, and a rank that dies."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.comm.rendezvous import held_store, store_env
from lightning_accel.models import GPT, MLP
from lightning_accel.pipeline.distributed import stage_indices
from lightning_accel.pipeline.schedule import one_f_one_b_order
from lightning_accel.pipeline.timeline import Event, measured_bubble, stage_orders
from tests.support.workers import WORKERS
from tests.support.workers.dist_worker import EVAL_SIZES, eval_batch
from tests.support.workers.remat_worker import chunk_counts
from tests.support.warm_python import python as warm_python

WORKER = WORKERS / "dist_worker.py"
REMAT_WORKER = WORKERS / "remat_worker.py"


def _launch(
    out: Path, schedule: str, mode: str, timeout: float = 60.0, worker: Path = WORKER, ranks: int = 2,
    ended: dict[int, float] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start ``ranks`` ranks of ``worker`` with Lightning-style env vars; kill all if they outlive ``timeout`` (so CI never hangs).
    ``ended``, if given, gets each rank's exit time (``time.monotonic``, to 50 ms), polled: only for a launch whose ranks
    print little (nothing reads their pipes meanwhile)."""
    store = held_store(timeout)  # a port nobody else can take between picking it and the ranks' rendezvous
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, **store_env(store.port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1", PIPE_TIMEOUT="20")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen([warm_python(), str(worker), str(out), schedule, mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    while ended is not None and len(ended) < len(procs) and time.monotonic() < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.monotonic()
        time.sleep(0.05)
    results = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"pipeline ranks still running after {timeout} s: a hang")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return results


def _reference():
    torch.manual_seed(0)
    net = MLP(6, 3, hidden=16, depth=4).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    loss = F.mse_loss(net(x), y)
    loss.backward()
    return {n: p.grad for n, p in net.named_parameters()}, loss.detach()


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


@pytest.fixture(scope="module")
def trained_and_evaluated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of two ranks that train, evaluate and raise with every schedule (the tests below read its
    files): each launch costs the ranks' start-up, importing torch and Lightning, before any step."""
    out = tmp_path_factory.mktemp("dist")
    results = _launch(out, ",".join(SCHEDULES), "train,eval,raise", timeout=180)
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    return out


def test_two_ranks_match_plain_training_for_every_schedule(trained_and_evaluated: Path):
    schedules, tmp_path = SCHEDULES, trained_and_evaluated
    ref_grads, ref_loss = _reference()
    for schedule in schedules:
        ranks = [torch.load(tmp_path / f"{schedule}-rank{r}.pt", weights_only=False) for r in range(2)]
        held = [{n for n, g in r["grads"].items() if g is not None} for r in ranks]
        grads = {n: r["grads"][n] for r, names in zip(ranks, held) for n in names}
        assert grads.keys() == ref_grads.keys(), schedule  # under the user's names
        # each block on one rank; outside the blocks, pre (the first stage's) on rank 0 and post (the last stage's) on
        # rank 1 only: a parameter gets a gradient only on the rank whose part of the forward uses it, and none is summed
        assert not held[0] & held[1], schedule
        assert {n for n in held[0] if not n.startswith("blocks.")} == {n for n in ref_grads if n.startswith("pre.")}
        assert {n for n in held[1] if not n.startswith("blocks.")} == {n for n in ref_grads if n.startswith("post.")}
        assert [r["summed_bytes"] for r in ranks] == [0, 0], schedule
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=f"{schedule}: {name}")
        assert ranks[0]["loss"] is None  # the loss lives on the last stage: rank 1 (stage 1, or 3 when interleaved)
        torch.testing.assert_close(ranks[1]["loss"], ref_loss, rtol=1e-10, atol=1e-12)
        # the recorded timeline is the schedule that ran: compare with the orders written out by hand
        events = [Event(*e) for r in ranks for e in r["events"]]
        orders = stage_orders(events)
        if schedule == "gpipe":  # torch's GPipe drains in increasing micro-batch order
            assert orders == [["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]] * 2
        elif schedule == "1f1b":
            assert orders == [["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
                              ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]
            assert orders == [[f"{a.kind}{a.microbatch}" for a in o] for o in one_f_one_b_order(4, 2)]
        else:  # 4 stages, 2 per rank: every micro-batch forward and backward once on each, forwards in order
            assert len(orders) == 4
            for order in orders:
                assert [a for a in order if a[0] == "F"] == ["F0", "F1", "F2", "F3"]
                assert sorted(a for a in order if a[0] == "B") == ["B0", "B1", "B2", "B3"]
        assert all(e.end >= e.start for e in events) and 0.0 <= measured_bubble(events) < 1.0
    # average_gradients (the data-parallel mean): in buckets of one dtype and at most 64 bytes, each gradient the
    # mean of rank 0's (1 x i) and rank 1's (2 x i); a parameter without a gradient keeps none
    for r in range(2):
        averaged = torch.load(tmp_path / f"averaged-rank{r}.pt", weights_only=False)
        assert averaged[-1] is None
        for i, (g, dtype) in enumerate(zip(averaged[:-1], [torch.float32, torch.float64, torch.float32, torch.bfloat16])):
            assert g.dtype == dtype and torch.equal(g, torch.full_like(g, 1.5 * (i + 1))), (r, i)
    # sum_over_users: parameters used by both ranks become 1 + 2 on both (one float32, one float64 buffer: 3*4 + 4*8
    # bytes); one used by this rank only keeps r + 1; one used by none keeps no gradient; the send/receive path too
    for r in range(2):
        result = torch.load(tmp_path / f"users-rank{r}.pt", weights_only=False)
        grads = result["grads"]
        assert torch.equal(grads[0], torch.full((3,), 3.0)) and torch.equal(grads[1], torch.full((4,), 3.0, dtype=torch.float64))
        assert torch.equal(grads[2], torch.full((5,), r + 1.0)) and grads[3] is None
        assert result["summed"] == 3 * 4 + 4 * 8
        assert torch.equal(result["between"], torch.full((6,), 3.0, dtype=torch.float64))


def _grads_equal_the_whole_models(out, name: str, world: int) -> tuple[list[dict], nn.Module]:
    """Load each rank's result of shared_params_worker; every gradient a rank holds equals the whole model's on the same
    batch, and together the ranks hold all of them. Returns the ranks' results and the reference model."""
    from tests.support.workers.shared_params_worker import batch, build, lm_loss

    ranks = [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(world)]
    reference = build(name)
    x, y = batch()
    lm_loss(reference(x), y).backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    for rank in ranks:
        for n, g in rank["grads"].items():
            torch.testing.assert_close(g, ref[n], rtol=1e-9, atol=1e-11, msg=f"{name}: {n}")
    assert set().union(*(r["grads"] for r in ranks)) == set(ref), name
    return ranks, reference


@pytest.mark.slow
def test_only_weights_two_stages_use_are_summed_and_gradients_equal_plain_training(tmp_path):
    """Outside the blocks, a parameter gets its gradient on the ranks that use it and is summed only where two do:
    transformers Llama (untied embedding and head) sums nothing, the embedding on rank 0 and norm and head on rank 1;
    GPT-2 (wte tied to lm_head) sums exactly wte, on both ranks, every step. Each gradient equals the whole model's."""
    pytest.importorskip("transformers")
    models = ["llama", "gpt2-no-dropout"]
    shared_params_worker = WORKER.with_name("shared_params_worker.py")
    results = _launch(tmp_path, ",".join(models), "train", timeout=120, worker=shared_params_worker)
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    for name in models:
        ranks, reference = _grads_equal_the_whole_models(tmp_path, name, 2)
        assert ranks[0]["users"] == ranks[1]["users"]
        users = ranks[0]["users"]
        if name == "llama":
            assert users == {"model.embed_tokens.weight": (0,), "model.norm.weight": (1,), "lm_head.weight": (1,)}
            assert [r["summed"] for r in ranks] == [[0, 0], [0, 0]]  # was embedding + norm + head, every step
        else:  # transformer.wte.weight is lm_head.weight
            wte = reference.transformer.wte.weight
            assert users["transformer.wte.weight"] == (0, 1) and users["transformer.wpe.weight"] == (0,)
            assert all(u == (1,) for n, u in users.items() if n.startswith("transformer.ln_f."))
            assert [r["summed"] for r in ranks] == [[wte.nbytes] * 2] * 2
            assert "transformer.wpe.weight" not in ranks[1]["grads"] and "transformer.ln_f.weight" not in ranks[0]["grads"]
    # a later step in which the last stage also uses pre.bias (only the first used it before) is refused on every rank:
    # rank 1's copy was never stepped, so summing from now on would train a stale value
    for r in range(2):
        message = (tmp_path / f"late-rank{r}.txt").read_text()
        assert re.fullmatch(r"pre\.bias got a gradient on pipeline rank\(s\) \[1\], which did not use it at its first step "
                            r"\(used by \[0\]\); .*requires_grad=False\)", message), message


@pytest.mark.slow
def test_a_tied_weight_is_summed_between_its_two_users_only_on_three_ranks(tmp_path):
    """GPT-2 in 3 stages: wte (tied to lm_head) is used by ranks 0 and 2, which sum it between them (sends, not an
    all-reduce over the pipeline); rank 1 uses nothing outside the blocks, sums nothing and holds no such gradient.
    Every gradient equals the whole model's."""
    pytest.importorskip("transformers")
    name = "gpt2-no-dropout"
    results = _launch(tmp_path, name, "train", timeout=120, worker=WORKER.with_name("shared_params_worker.py"), ranks=3)
    assert [r.returncode for r in results] == [0, 0, 0], "\n".join(r.stdout[-3000:] for r in results)
    ranks, reference = _grads_equal_the_whole_models(tmp_path, name, 3)
    assert ranks[0]["users"]["transformer.wte.weight"] == (0, 2)
    assert not [n for n in ranks[1]["grads"] if not n.startswith("transformer.h.")]
    nbytes = reference.transformer.wte.weight.nbytes
    assert [r["summed"] for r in ranks] == [[nbytes] * 2, [0, 0], [nbytes] * 2]


def test_evaluation_streams_micro_batches_and_equals_the_whole_model(trained_and_evaluated: Path):
    """forward splits each batch into min(chunks=4, size) micro-batches (tensor_split sizes) and returns, on the
    last stage's rank, the unsplit float64 model's output: a batch that divides, one that does not, one smaller
    than chunks, one sample; one stage per rank and two (interleaved: stage s on rank s % 2)."""
    schedules, tmp_path = SCHEDULES, trained_and_evaluated
    torch.manual_seed(0)
    net = MLP(6, 3, hidden=16, depth=4).double().eval()
    micro_sizes = {8: [2, 2, 2, 2], 7: [2, 2, 2, 1], 3: [1, 1, 1], 1: [1]}
    for schedule in schedules:
        ranks = [torch.load(tmp_path / f"eval-{schedule}-rank{r}.pt", weights_only=False) for r in range(2)]
        assert all(out is None for out in ranks[0]["outputs"].values()), schedule  # the last stage is on rank 1
        for size in EVAL_SIZES:
            with torch.no_grad():
                expected = net(eval_batch(size))
            torch.testing.assert_close(ranks[1]["outputs"][size], expected, rtol=1e-12, atol=1e-14, msg=f"{schedule}: {size}")
        stages = {s: seen for rank in ranks for s, seen in rank["seen"].items()}
        assert sorted(stages) == list(range(4 if schedule == "interleaved_1f1b" else 2))
        for s, seen in stages.items():
            assert seen == [n for size in EVAL_SIZES for n in micro_sizes[size]], f"{schedule}: stage {s}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stages_error_ends_the_step_on_every_rank_as_itself_and_the_next_step_trains(trained_and_evaluated: Path, schedule):
    """Rank 0's block raises MyError in the first step's shape inference, rank 1's last block in the backward of the
    second step's micro-batch 1: each step raises that MyError on both ranks (a copy on the peer), its message naming
    where, and the third step's gradients and loss are plain training's; so do two evaluations (a streamed micro-batch on
    rank 0, the last stage's whole batch on rank 1), and the next one streams the batch. Before: the peer waited for
    activations or gradients that never came, until the process group's timeout."""
    ranks = [torch.load(trained_and_evaluated / f"raise-{schedule}-rank{r}.pt", weights_only=False) for r in range(2)]
    last = 3 if schedule == "interleaved_1f1b" else 1
    for r in ranks:
        assert r["errors"] == [
            ("MyError", "first forward (raised by pipeline stage 0 on rank 0)", False),
            ("MyError", f"second backward (raised by pipeline stage {last} on rank 1)", True),
            ("MyError", "evaluated (raised by pipeline stage 0 on rank 0)", False),
            ("MyError", f"whole batch (raised by pipeline stage {last} on rank 1)", False),
        ]
    ref_grads, ref_loss = _reference()
    grads = {n: g for r in ranks for n, g in r["grads"].items() if g is not None}
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=f"{schedule}: {name}")
    torch.testing.assert_close(ranks[1]["loss"], ref_loss, rtol=1e-10, atol=1e-12)
    torch.manual_seed(0)
    net = MLP(6, 3, hidden=16, depth=4).double()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert ranks[0]["output"] is None
    torch.testing.assert_close(ranks[1]["output"], net(x), rtol=1e-10, atol=1e-12)  # no step taken: the initial weights


def test_a_stages_error_stops_every_replica_at_the_same_step(tmp_path):
    """Two pipelines of 2 ranks each, told of failures together (as DistributedGPipeStrategy does with 2+ replicas):
    rank 0's block raises in the second step; its pipeline raises MyError, the other replica one line, all at that step,
    so no replica waits for the failed one in the gradient average (before: until the process group's timeout)."""
    results = _launch(tmp_path, "1f1b", "replicas", timeout=120, ranks=4)
    assert [r.returncode for r in results] == [0] * 4, "\n".join(r.stdout[-2000:] for r in results)
    said = [(tmp_path / f"replicas-rank{r}.txt").read_text() for r in range(4)]
    assert said[:2] == ["trained | MyError: replica 0 (raised by pipeline stage 0 on rank 0)"] * 2
    assert said[2:] == [f"trained | RuntimeError: pipeline step stopped on rank {r}: a rank of another pipeline replica "
                        "raised; its log has the traceback" for r in (2, 3)]


def test_rematerialized_micro_batches_run_twice_and_keep_plain_gradients(tmp_path):
    """checkpoint="always" / "except_last" / "never" for M in {1, 2, 4, 8}, gpipe and 1f1b: the gradients of plain
    training, and each block runs forward once per micro-batch plus once per re-materialized one (so the mode is no no-op)."""
    schedules, modes = ["gpipe", "1f1b"], ["never", "except_last", "always"]
    results = _launch(tmp_path, ",".join(schedules), ",".join(modes), timeout=180, worker=REMAT_WORKER)
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stdout[-3000:] for r in results)
    ref_grads, _ = _reference()
    ranks = [torch.load(tmp_path / f"remat-rank{r}.pt", weights_only=False) for r in range(2)]
    for schedule in schedules:
        for mode in modes:
            for chunks in chunk_counts(schedule):
                key = (schedule, mode, chunks)
                grads = {**ranks[0][key]["grads"], **ranks[1][key]["grads"]}
                assert grads.keys() == ref_grads.keys(), key
                for name, g in ref_grads.items():
                    torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=f"{key}: {name}")
                again = {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]
                for rank in ranks:
                    assert rank[key]["calls"] == rank[key]["blocks"] * (chunks + again), key


def test_a_rank_dying_mid_step_ends_every_rank_with_an_error_naming_it(tmp_path):
    ended: dict[int, float] = {}
    results = _launch(tmp_path, "gpipe", "die", timeout=240, ended=ended)  # only a hang takes 240 s
    assert results[1].returncode == 3
    assert results[0].returncode == 4, results[0].stdout[-3000:]
    assert "rank 0 error: pipeline step failed on rank 0 (stages [0]) while exchanging with rank(s) [1]" in results[0].stdout
    # Rank 0 ends on its peer's death, not at the process group's timeout (PIPE_TIMEOUT, 20 s: a rank left waiting
    # ends at least that long after the death). Timed from rank 1's exit, not from the launch: two ranks importing
    # torch on a loaded 2-core machine took 57 s before any step (3 s apart here, beside a busy loop).
    assert ended[0] - ended[1] < 15, ended


def test_stage_boundaries_run_the_models_own_forward_stage_by_stage():
    """Stage 0 stops after its last block and returns that output; stage 1, its predecessor's blocks on meta, takes the
    received activation in their place and runs the model's forward to the end: together, the whole model's output."""
    import copy

    from lightning_accel.pipeline.boundaries import StageBoundaries

    torch.manual_seed(0)
    net = MLP(6, 3, hidden=8, depth=4)
    x = torch.randn(2, 6)
    expected = net(x)
    first, last = copy.deepcopy(net), copy.deepcopy(net)
    for k in (1, 2, 3):
        first.blocks[k].to("meta")
    last.blocks[0].to("meta")
    hidden = StageBoundaries(list(first.blocks), [1, 3]).run(0, None, lambda: first(x))
    torch.testing.assert_close(hidden, first.blocks[0](first.pre(x)))
    torch.testing.assert_close(StageBoundaries(list(last.blocks), [1, 3]).run(1, hidden, lambda: last(x)), expected)
    assert stage_indices(1, 2, "1f1b") == [1] and stage_indices(1, 2, "interleaved_1f1b") == [1, 3]
    assert stage_indices(1, 2, "interleaved_zb") == [1, 3]
    # V-wise: rank r of W holds r and 2W - 1 - r (on 4 ranks: 0 and 7, ..., 3 and 4)
    assert [stage_indices(r, 2, "zbv") for r in range(2)] == [[0, 3], [1, 2]]
    assert [stage_indices(r, 4, "dualpipev") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_a_stage_refuses_a_forward_that_runs_the_network_twice_in_one_micro_batch():
    """A step that calls the network twice (two loaders' batches, one after the other): the later stage would hand the
    same received activation to the second call, a silently wrong output (the multiple_train_dataloaders conformance
    cell trained 4e-3 off); it is refused in one line instead, at that call."""
    import copy

    from lightning_accel.pipeline.boundaries import StageBoundaries

    net = MLP(6, 3, hidden=8, depth=2)
    last = copy.deepcopy(net)
    last.blocks[0].to("meta")
    boundaries = StageBoundaries(list(last.blocks), [1, 1])
    hidden = torch.randn(2, 8)
    x = torch.randn(2, 6)
    boundaries.run(1, hidden, lambda: last(x))  # once: fine
    with pytest.raises(ValueError, match=r"^the model's forward ran 'block 0' twice in one micro-batch \(the network called twice "
                       r"in one step\); .*call the network once per step .*or train with strategy='ddp'$"):
        boundaries.run(1, hidden, lambda: (last(x), last(x)))


def test_stage_boundaries_restore_puts_back_a_forward_the_users_instance_already_had():
    from lightning_accel.pipeline.boundaries import StageBoundaries

    net = MLP(6, 3, hidden=8, depth=2)
    own = net.blocks[1].forward
    net.blocks[1].forward = own  # type: ignore[method-assign]
    boundaries = StageBoundaries(list(net.blocks), [1, 1])
    assert vars(net.blocks[1])["forward"] is not own
    boundaries.restore()
    assert vars(net.blocks[1])["forward"] is own and "forward" not in vars(net.blocks[0])


def test_a_block_returning_two_tensors_sends_both_and_the_next_stage_puts_them_back():
    """A stage ending in a block that returns a pair sends both tensors; the next stage gets them back in the pair's
    place (the structure recorded where the block ran, not by running it on meta): the whole model's output. Before:
    "block 'blocks.0' returned 2 tensors; a pipeline stage sends one activation". A block returning no tensor is
    refused."""
    import copy

    from lightning_accel.pipeline.boundaries import StageBoundaries

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x), {"gate": torch.sigmoid(x), "note": "kept"}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Two(), Two()])

        def forward(self, x):
            h, extra = self.blocks[0](x)
            assert extra["note"] == "kept"
            return self.blocks[1](h * extra["gate"])[0]

    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3)
    expected = net(x)
    first, last = copy.deepcopy(net), copy.deepcopy(net)
    last.blocks[0].to("meta")
    names = ["blocks.0", "blocks.1"]
    sent_by = StageBoundaries(list(first.blocks), [1, 1], names)
    sent = sent_by.run(0, None, lambda: first(x))
    assert isinstance(sent, tuple) and len(sent) == 2
    receiver = StageBoundaries(list(last.blocks), [1, 1], names)
    receiver.structures.update(sent_by.structures)  # what torch's shape metadata carries to the next rank
    torch.testing.assert_close(receiver.run(1, sent, lambda: last(x)), expected)

    class Nothing(nn.Module):
        def forward(self, x):
            return None

    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Nothing(), Nothing()])

        def forward(self, x):
            self.blocks[0](x)
            return self.blocks[1](x)

    empty = Empty()
    with pytest.raises(ValueError, match=r"block 'blocks.0' returned no tensor \(NoneType\); .*; choose blocks"):
        StageBoundaries(list(empty.blocks), [1, 1], names).run(0, None, lambda: empty(torch.ones(1)))


def test_a_block_tensor_shared_with_the_rest_of_the_model_is_refused():
    from lightning_accel.pipeline.stage_module import shared_parameters
    from lightning_accel.models.block_policy import find_blocks

    net = GPT("tiny", n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32, tie_weights=False)
    net.post.lm_head.weight = next(net.blocks[1].parameters())  # a head tied to a block's weight
    with pytest.raises(ValueError, match=r"post.lm_head.weight is also blocks.1.*a block's parameter.*; untie it"):
        shared_parameters(net, find_blocks(net), [1, 1])
    tied = GPT("tiny", n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32)  # embedding = head: both outside
    assert len(shared_parameters(tied, find_blocks(tied), [1, 1])) == len(list(tied.parameters())) - sum(
        len(list(b.parameters())) for b in tied.blocks
    )


def test_shapes_that_change_between_steps_fail_before_the_step(one_rank_group):
    from lightning_accel.pipeline.distributed import RankPipeline

    torch.manual_seed(0)
    net = MLP(6, 3, hidden=8, depth=2)
    pipe = RankPipeline(net, [2], chunks=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    torch.testing.assert_close(pipe.step(x, y), F.mse_loss(net(x), y))  # one stage: the plain loss
    with pytest.raises(ValueError, match=r"batch shapes \(inputs, target\) \(\(2, 6\), \(2, 3\)\) differ from the first step's \(\(4, 6\), \(4, 3\)\).*drop_last=True"):
        pipe.step(torch.randn(2, 6), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"batch shapes \(inputs, target\) \(\(5, 6\), \(5, 3\)\) differ from the first"):
        pipe.step(torch.randn(5, 6), torch.randn(5, 3))
    odd = RankPipeline(MLP(6, 3, hidden=8, depth=2), [2], chunks=2, loss_fn=F.mse_loss)  # 5: one micro-batch of 5
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    torch.testing.assert_close(odd.step(x, y), F.mse_loss(odd.net(x), y))
    assert odd.step_chunks == 1


def test_schedule_needing_more_micro_batches_fails_before_building(one_rank_group):
    from lightning_accel.pipeline.distributed import RankPipeline

    with pytest.raises(ValueError, match=r"schedule 'interleaved_1f1b' needs at least as many micro-batches as stages \(chunks=1, stages=2\)"):
        RankPipeline(MLP(6, 3, hidden=8, depth=2), [1, 1], chunks=1, loss_fn=F.mse_loss, schedule="interleaved_1f1b")
