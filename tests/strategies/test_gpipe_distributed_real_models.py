"""DistributedGPipeStrategy on models this project did not write (transformers Llama, GPT-2, Qwen2, Mistral; litgpt GPT),
on 2 gloo ranks launched by Lightning, against plain single-process Lightning: float64, the same seeded start and data.
The ranks get the user's shuffling DataLoader with Lightning's defaults (its distributed sampler left on: a pipeline is
one replica); the references read the order that sampler gives. Under GPipe the step runs once per batch, so the
reference is plain Lightning on the same whole batches; under the other schedules the last rank runs it per micro-batch,
so a token-averaged loss over right-padded samples is averaged per micro-batch (the micro-batches of a shuffled batch hold
different numbers of padded tokens, which a sequential order happened to hide) and the reference accumulates over the
same micro-batches."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

from tests.support.real_models import assert_same_weights, fit, lm_loader, seq2seq_data, seq2seq_task, shuffled_order  # noqa: E402
from tests.support.regression_models import ROWS, max_difference, tolerance  # noqa: E402
from tests.support.user_script import finish_beside, params_of_collected, start_user_script  # noqa: E402
from tests.support.workers import WORKERS  # noqa: E402
from tests.support.workers.real_models_worker import CHUNKS, SEQ2SEQ_SAMPLES, STEPS, VAL_SAMPLES, task  # noqa: E402

# GPT-2 without dropout: micro-batches draw other dropout masks than one whole batch does
CASES = [
    ("llama", "gpipe"), ("llama", "1f1b"), ("gpt2-no-dropout", "gpipe"), ("gpt2-no-dropout", "1f1b"),
    ("litgpt", "gpipe"), ("litgpt", "1f1b"), ("qwen2", "gpipe"), ("mistral", "1f1b"),
    # torch's zero-bubble schedules, two stages per rank (looped; V-wise: rank 0 runs the embedding and the head)
    ("llama4", "interleaved_zb"), ("llama4", "zbv"), ("llama4", "dualpipev"),
]
# encoder-decoders: blocks='auto' pipelines the encoder's blocks, then the decoder's (by size): T5 on 1f1b as [3, 2]
# (rank 0 runs the encoder and the first decoder block and sends the encoder's output on beside its own), BART on
# interleaved_1f1b as [1, 1, 1, 1] (the encoder on both ranks; stage 2 receives the encoder's output and carries it to
# stage 3)
ENCODER_DECODER_CASES = [("t5", "1f1b"), ("bart", "interleaved_1f1b")]
# the regression rows of docs/models.md (regression_models: BERT, GPT-NeoX, Gemma 3, Mamba, ViT, Llama frozen, LoRA, own
# checkpointing, compiled layers, Mixtral and Qwen3-MoE in float32), 1f1b, in this same launch, each against its one
# plain-Lightning reference; and Mixtral in bf16-mixed
ROW_CASES = [*((f"row-{name}", "1f1b") for name in ROWS), ("row-mixtral@bf16-mixed", "1f1b")]


def sampled(dataset=None):
    """What Lightning's DistributedSampler feeds the pipeline from the workers' shuffled loader, as a plain loader of the
    pipeline's micro-batches (accumulate CHUNKS of 8 / CHUNKS)."""
    from torch.utils.data import DataLoader

    dataset = lm_loader().dataset if dataset is None else dataset
    return DataLoader(dataset, batch_size=8 // CHUNKS, sampler=shuffled_order(len(dataset)))


@functools.lru_cache(maxsize=None)
def _plain(name: str, whole: bool = False) -> torch.nn.Module:
    """Plain Lightning's float64 run of ``name`` on the pipeline's micro-batches accumulated (the other schedules: their
    last rank runs training_step per micro-batch), or ``whole``: on its whole batches of 8 (GPipe: training_step runs once
    per batch, lightning_accel.pipeline.whole_step)."""
    from torch.utils.data import DataLoader

    reference = task(name)
    if whole:
        dataset = lm_loader().dataset
        loader = DataLoader(dataset, batch_size=8, sampler=shuffled_order(len(dataset)))
        fit(reference, steps=STEPS, precision="64-true", loader=loader)
    else:
        fit(reference, steps=STEPS, precision="64-true", loader=sampled(), accumulate_grad_batches=CHUNKS)
    return reference


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """The worker's output directory. While its 2 ranks run (together about one core busy), this process fits the plain
    references the session's test_real_models_train_like_plain_lightning cases need; one after the other, those waited
    for the ranks' whole launch."""
    out = tmp_path_factory.mktemp("real_models")
    cases = ",".join(f"{m}:{s}" for m, s in CASES + ENCODER_DECODER_CASES + ROW_CASES)
    job = start_user_script(WORKERS / "real_models_worker.py", [str(out), cases], 300, "2-process real models")
    names = set(params_of_collected(request, test_real_models_train_like_plain_lightning, "name"))
    finish_beside(job, lambda: [_plain(m, s == "gpipe") for m, s in CASES if m in names])
    return out


def _loaded(name: str, checkpoint: Path, build=task) -> torch.nn.Module:
    """The gathered checkpoint in a plain model: every name of the user's model, nothing else (strict)."""
    plain = build(name)
    plain.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"], strict=True)
    return plain


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_real_models_train_like_plain_lightning(two_ranks, name, schedule):
    assert_same_weights(_plain(name, schedule == "gpipe"), _loaded(name, two_ranks / f"{name}-{schedule}.ckpt"), rtol=1e-9, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule", "rtol"), [(*case, tol) for case, tol in zip(ENCODER_DECODER_CASES, (1e-5, 1e-9))])
def test_encoder_decoders_train_like_plain_lightning(two_ranks, name, schedule, rtol):
    # T5's layer norm takes its variance in float32 (transformers' T5LayerNorm) even in a float64 model, so its rounding
    # differs with the micro-batch layout: 1e-5 (measured 2.5e-8 abs; BART 9.2e-15). With a decoder stage cut from the
    # encoder's output, the weights move ~1e-2 apart (5.9e-2 measured on T5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: tiny float64 models gain nothing from more (2 threads on a loaded CPU: 20 s)
    try:
        reference = seq2seq_task(name)
        fit(reference, steps=STEPS, precision="64-true", loader=sampled(seq2seq_data(SEQ2SEQ_SAMPLES)), accumulate_grad_batches=CHUNKS)
    finally:
        torch.set_num_threads(threads)
    assert_same_weights(reference, _loaded(name, two_ranks / f"{name}-{schedule}.ckpt", seq2seq_task), rtol=rtol, atol=rtol * 1e-2)
    # validation of the trained model: its batch of 6 streamed through the stages in micro-batches of 2, 2, 1, 1, the
    # encoder's output carried as in training (before: T5 stopped, its position bias gathered into a batch of 4)
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    plain = pl.Trainer(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False)
    expected = plain.validate(reference, DataLoader(seq2seq_data(VAL_SAMPLES), batch_size=VAL_SAMPLES), verbose=False)[0]["val_loss"]
    for rank in range(2):
        got = json.loads((two_ranks / f"{name}-{schedule}-rank{rank}.json").read_text())["val_loss"]
        assert got == pytest.approx(expected, rel=rtol), (rank, got, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), ENCODER_DECODER_CASES)
def test_an_encoder_decoders_blocks_are_each_on_one_rank(two_ranks, name, schedule):
    """While training, each rank holds its stages' blocks of both stacks, the others' on meta: every encoder block's
    parameters on exactly one rank (the encoder ran whole on every rank before: 2x its blocks' parameters)."""
    from tests.support.real_models import BLOCK_STACKS

    net = seq2seq_task(name).net
    held = [json.loads((two_ranks / f"{name}-{schedule}-rank{r}.json").read_text()) for r in range(2)]
    for stack in BLOCK_STACKS[name]:
        total = sum(p.numel() for n, p in net.named_parameters() if n.startswith(f"{stack}."))
        assert sum(h[stack] for h in held) == total, (stack, total, held)


@pytest.mark.slow
@pytest.mark.parametrize("name", ROWS)
def test_regression_rows_train_like_plain_lightning(two_ranks, name):
    """The user's shuffling loader with Lightning's distributed sampler, 4 micro-batches of 2, 1f1b: the row's weights
    after 3 steps against plain Lightning's on the sampler's order (no padding, so accumulating the micro-batches'
    means is the batch's mean: one reference with l2l_offload and gpipe, test_regression_rows.py)."""
    state = torch.load(two_ranks / f"row-{name}-1f1b.ckpt", weights_only=False)["state_dict"]
    difference = max_difference(name, state)
    assert difference <= tolerance(name), f"{name}: max abs weight difference {difference:.2e} from plain Lightning"


@pytest.mark.slow
def test_a_mixture_of_experts_in_bf16_mixed_trains_like_plain_lightning_on_the_same_micro_batches(two_ranks):
    """Mixtral in bf16-mixed (autocast; its experts' grouped_mm in bf16): equal (measured 0.0) to plain Lightning in
    bf16-mixed accumulating the pipeline's 4 micro-batches, both on one thread (a two-thread reference: 7.6e-6, CPU
    kernels split their sums by thread); bf16 rounds differently over one whole batch (1.1e-2)."""
    state = torch.load(two_ranks / "row-mixtral@bf16-mixed-1f1b.ckpt", weights_only=False)["state_dict"]
    assert max_difference("mixtral", state, "bf16-mixed", accumulate=CHUNKS) <= 1e-6
    assert max_difference("mixtral", state, "bf16-mixed") > 1e-3  # the comparison tells micro-batches apart


@pytest.mark.slow
def test_resuming_a_real_model_from_the_gathered_checkpoint_is_exact(two_ranks, tmp_path):
    """Llama: 2 steps, saved; resumed in a fresh Trainer to step 4 equals plain Lightning resuming the same checkpoint
    (the checkpoint ends mid-epoch, so both replay the loader alike), and the 2-step checkpoint equals plain's 2 steps."""
    half = task("llama")
    fit(half, steps=STEPS // 2, precision="64-true")
    assert_same_weights(half, _loaded("llama", two_ranks / "llama-gpipe-half.ckpt"), rtol=1e-9, atol=1e-11)
    plain = task("llama")
    fit(plain, steps=STEPS, precision="64-true", ckpt_path=two_ranks / "llama-gpipe-half.ckpt")
    assert_same_weights(plain, _loaded("llama", two_ranks / "llama-gpipe-resumed.ckpt"), rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_llama_train_like_plain_lightning_on_the_global_batch(tmp_path):
    """DP x PP on 4 ranks: each replica's shard (Lightning's DistributedSampler, seed 0) in 2 micro-batches per stage;
    the replicas' averaged gradients equal plain Lightning's on the global batch (both shards together)."""
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.support.workers.dp_pp_real_worker import PER_RANK, STEPS, dataset

    import lightning.pytorch as pl

    job = start_user_script(WORKERS / "dp_pp_real_worker.py", [str(tmp_path)], 300, "4-process DP x PP Llama")
    try:  # the reference trains while the ranks run
        data = dataset()
        shards = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
        order = [i for b in range(len(shards[0]) // PER_RANK) for shard in shards for i in shard[b * PER_RANK : (b + 1) * PER_RANK]]
        reference = task("llama")
        pl.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        ).fit(reference, DataLoader(data, batch_size=2 * PER_RANK, sampler=order))
    except BaseException:
        job.kill()
        raise
    result = job.result()
    assert result.returncode == 0, result.stdout[-4000:]
    assert_same_weights(reference, _loaded("llama", tmp_path / "llama-dp-pp.ckpt"), rtol=1e-9, atol=1e-11)
