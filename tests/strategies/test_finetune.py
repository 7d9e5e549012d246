"""Fine-tuning what people download, under every strategy: peft LoRA on a frozen Llama loaded in bf16, and on an NF4
base (torchao, as QLoRA). The base stays bit-identical (its NF4 type too), the adapters' update equals plain
Lightning's, and L2L keeps a frozen weight at its stored size on the host.

Before frozen parameters were kept as stored, L2L gave every frozen weight an fp32 master and a bf16 shadow (6 bytes a
parameter) and turned the NF4 weights into dequantized fp32 masters: the model computed in other dtypes than the
user's (adapters 3e-2 off plain's here) and after fit the NF4 weights were plain fp32 tensors.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

# peft and torchao come with the finetune extra (and the test extra): without them nothing here can run, the
# multi-process workers included
pytest.importorskip("peft")
pytest.importorskip("torchao")

import lightning_accel.strategies.l2l_offload_hooks as l2l_module  # noqa: E402
from lightning_accel import GPipeStrategy, L2LOffloadStrategy, OffloadPrecision  # noqa: E402
from lightning_accel.offload import L2LExecutor  # noqa: E402

from tests.support.finetune_models import WIDE, adapters, assert_frozen_unchanged, frozen, lora_llama, qlora_task, relative_update_difference  # noqa: E402
from tests.support.finetune_models import state_entries  # noqa: E402
from tests.support.real_models import CausalLM, fit, lm_loader  # noqa: E402
from tests.support.workers import WORKERS  # noqa: E402

KINDS = ("bf16", "nf4")


@functools.lru_cache(maxsize=None)
def _plain(kind: str, micro_batch: int | None = None) -> dict[str, torch.Tensor]:
    """Plain Lightning's adapters after 4 bf16-mixed steps; with ``micro_batch``, accumulating over batches of that size
    (what a pipeline's micro-batches compute), in the order ``sampler`` gives."""
    task = CausalLM(lora_llama(nf4=kind == "nf4"), lr=1e-3)
    if micro_batch is None:
        fit(task, steps=4, precision="bf16-mixed")
    else:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, precision="bf16-mixed", accumulate_grad_batches=8 // micro_batch,
        )
        trainer.fit(task, lm_loader(batch_size=micro_batch))
    return adapters(task.net)


def _start(kind: str) -> tuple[CausalLM, dict[str, torch.Tensor], dict]:
    task = CausalLM(lora_llama(nf4=kind == "nf4"), lr=1e-3)
    return task, adapters(task.net), frozen(task.net)


@pytest.mark.parametrize("copies", [False, True], ids=["cpu", "copies"])
@pytest.mark.parametrize("kind", KINDS)
def test_l2l_trains_adapters_like_plain_lightning_and_leaves_the_base_as_stored(kind: str, copies: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if copies:  # every trainable weight copied to a fresh device tensor, as on a GPU; frozen ones streamed as stored
        monkeypatch.setattr(l2l_module, "L2LExecutor", functools.partial(L2LExecutor, alias=False))
    task, start, base = _start(kind)
    strategy = L2LOffloadStrategy()
    fit(task, strategy, steps=4, plugins=[OffloadPrecision("bf16-mixed")])
    assert_frozen_unchanged(base, task.net)
    assert relative_update_difference(start, _plain(kind), adapters(task.net)) < 1e-5  # measured 2.6e-7: rounding only
    # only the adapters' gradients cross back (in bf16, their device copies' dtype); nothing for the frozen base
    adapter_numel = sum(p.numel() for p in task.net.parameters() if p.requires_grad)
    assert strategy.offload_stats.d2h_bytes_per_step == 2 * adapter_numel


@pytest.mark.parametrize(("kind", "most"), [("bf16", 2.1), ("nf4", 0.65)])
def test_l2l_host_bytes_per_offloaded_parameter(kind: str, most: float, caplog: pytest.LogCaptureFixture) -> None:
    """A bf16 base keeps 2 bytes a frozen parameter, an NF4 one ~0.52, plus the adapters' masters, shadows and gradient
    buffers (LoRA r=8 on q/v: 0.6% of a block, as on a 7B model). Before: 6 B (bf16) and 6 B (NF4) a parameter."""
    net = lora_llama(nf4=kind == "nf4", dims=WIDE, layers=2)
    strategy = L2LOffloadStrategy()
    fit(CausalLM(net, lr=1e-3), strategy, steps=1, plugins=[OffloadPrecision("bf16-mixed")])
    stats = strategy.offload_stats
    blocks = net.base_model.model.model.layers
    assert stats.offloaded_params == sum(p.numel() for p in blocks.parameters())
    stored = 2 if kind == "bf16" else 0.518  # torchao's NF4: 4-bit codes, a scaler per 64, double-quantized
    assert stored < stats.host_bytes_per_param <= most
    host = [p for n, p in blocks.named_parameters() if p.requires_grad]
    assert stats.host_optimizer_bytes == 8 * sum(p.numel() for p in host) + 4 * len(host)  # AdamW: two moments, a step
    assert f"({stats.host_bytes_per_param:.2f} B each; " in caplog.text  # the plan line says it


def test_unfreezing_a_quantized_weight_during_fit_is_refused_at_that_step() -> None:
    """A bf16 base weight unfrozen mid-fit trains (tests/strategies/test_l2l_unfreeze.py); an NF4 one cannot: refused
    in one line naming it, at the step it was unfrozen, before that step computes anything."""
    task, _, _ = _start("nf4")

    class Unfreeze(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *_: object) -> None:
            if trainer.global_step == 1:
                module.net.base_model.model.model.layers[1].mlp.up_proj.weight.requires_grad_(True)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[OffloadPrecision("bf16-mixed")], callbacks=[Unfreeze()])
    with pytest.raises(RuntimeError, match=r"^L2LOffloadStrategy: parameter .*layers\.1\.mlp\.up_proj\.weight is stored as "
                                           r"NF4Tensor \(quantized\), which cannot train, and it was set to require grad after "
                                           r"the offload was planned; keep it frozen \(requires_grad=False\) and train an adapter"):
        trainer.fit(task, lm_loader())
    assert trainer.global_step == 1


class _WithBackbone(CausalLM):
    """A QLoRA task whose LightningModule names its blocks ``backbone``, as ``BackboneFinetuning`` requires."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.net.base_model.model.model.layers


def test_backbone_finetuning_of_a_quantized_backbone_is_refused_before_the_first_step() -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    task = _WithBackbone(lora_llama(nf4=True), lr=1e-3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: BackboneFinetuning\(unfreeze_backbone_at_epoch=1\) unfreezes the "
                                         r"LightningModule's backbone, whose parameter net\.base_model\.model\.model\.layers\.0\."
                                         r"self_attn\.q_proj\.base_layer\.weight is stored as NF4Tensor \(quantized\), which cannot "
                                         r"train; keep it frozen"):
        trainer.fit(task, lm_loader())
    assert trainer.global_step == 0


@pytest.mark.parametrize("kind", KINDS)
def test_gpipe_trains_adapters_like_plain_lightning_on_the_same_micro_batches(kind: str) -> None:
    task, start, base = _start(kind)
    fit(task, GPipeStrategy(devices=2, chunks=2), steps=4, precision="bf16-mixed")
    assert_frozen_unchanged(base, task.net)
    assert relative_update_difference(start, _plain(kind, micro_batch=4), adapters(task.net)) == 0.0


def test_the_lora_recipe_fine_tunes_a_save_pretrained_directory_named_alone(tmp_path: Path) -> None:
    """``llama-tiny_lora_cpu model.net.pretrained_path=DIR`` and nothing else: the directory's Llama (2 layers of 64, not
    the recipe's 4 of 128) with its saved weights as the frozen base, LoRA on q/v; two steps train the adapters only.
    Before, the recipe's own model.net.config made it refused ("got both pretrained_path=... and a config")."""
    import transformers
    from torch.utils.data import TensorDataset

    from lightning_accel.config.compose import compose_recipe
    from lightning_accel.runner import build_model

    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    saved.save_pretrained(tmp_path / "base")
    task = build_model(compose_recipe("llama-tiny_lora_cpu", [f"model.net.pretrained_path={tmp_path / 'base'}"]))
    base = task.net.get_base_model()
    assert base.config.num_hidden_layers == 2 and base.config.hidden_size == 64
    torch.testing.assert_close(base.model.embed_tokens.weight, saved.model.embed_tokens.weight, rtol=0, atol=0)
    start, frozen_before = adapters(task.net), frozen(task.net)
    assert start and all(".lora_" in n for n in start)
    tokens, targets, _ = lm_loader().dataset.tensors
    fit(task, steps=2, loader=DataLoader(TensorDataset(tokens, targets), batch_size=8))
    assert_frozen_unchanged(frozen_before, task.net)
    assert all(not torch.equal(adapters(task.net)[n], start[n]) for n in start if ".lora_B" in n)


def _fit_qlora_task(strategy: Any, out: Path, resume: Path | None = None) -> pl.LightningModule:
    """Our QLoRA task (``model/adapter=qlora``, 2 layers) for 2 bf16-mixed steps, a checkpoint after each (none when
    resuming)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    every = ModelCheckpoint(dirpath=out, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=1, save_top_k=-1)
    tokens, targets, _ = lm_loader().dataset.tensors
    task = qlora_task(layers=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, precision="bf16-mixed", logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[every] if resume is None else [],
        enable_checkpointing=resume is None,
    )
    trainer.fit(task, StatefulDataLoader(TensorDataset(tokens, targets), batch_size=8), ckpt_path=resume)
    return task


@pytest.mark.parametrize("strategy", ["gpipe", "l2l_offload"])
def test_a_finetune_checkpoint_under_one_process_strategies_holds_the_adapters_and_resumes_exactly(strategy: str, tmp_path: Path) -> None:
    """``gpipe`` (2 CPU stages) and ``l2l_offload``: the checkpoint holds the adapters only and names the base by
    its hash; a fit resumed from step 1 ends on the uninterrupted fit's adapters, bit for bit, the NF4 base as it was."""
    from lightning_accel.models.finetune_checkpoint import fingerprint

    make = {"gpipe": lambda: GPipeStrategy(devices=2, chunks=2), "l2l_offload": lambda: L2LOffloadStrategy()}[strategy]
    full = _fit_qlora_task(make(), tmp_path)
    half = torch.load(tmp_path / "step1.ckpt", weights_only=False)
    trainable = {n for n, p in full.named_parameters() if p.requires_grad}
    assert set(half["state_dict"]) == trainable and half["finetune"]["sha256"] == fingerprint(qlora_task(layers=2))
    base = frozen(full)
    resumed = _fit_qlora_task(make(), tmp_path / "resumed", resume=tmp_path / "step1.ckpt")
    want, got = adapters(full), adapters(resumed)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert not all(torch.equal(half["state_dict"][n].float(), want[n]) for n in want)  # it trained past the checkpoint
    assert_frozen_unchanged(base, resumed)


@functools.lru_cache(maxsize=None)
def _pipeline_reference(kind: str) -> dict[str, torch.Tensor]:
    """Plain Lightning's adapters after 4 bf16-mixed steps accumulating a pipeline's 2 micro-batches of 4, in the shuffled
    order Lightning's distributed sampler gives one replica (a pipeline's ranks read it too)."""
    reference, _, _ = _start(kind)
    sampler = list(DistributedSampler(lm_loader().dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, precision="bf16-mixed", accumulate_grad_batches=2,
    )
    trainer.fit(reference, DataLoader(lm_loader().dataset, batch_size=4, sampler=sampler))
    return adapters(reference.net)


@pytest.fixture(scope="module")
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank LoRA / QLoRA worker's outputs; while its ranks run, this process fits the plain references of the
    session's test_gpipe_distributed_trains_adapters_like_plain_lightning cases (one after the other before)."""
    from tests.support.user_script import finish_beside, params_of_collected, start_user_script

    out = tmp_path_factory.mktemp("finetune")
    job = start_user_script(WORKERS / "finetune_worker.py", [str(out)], 300, "2-process LoRA / QLoRA")
    finish_beside(job, lambda: [_pipeline_reference(v) for v in params_of_collected(request, test_gpipe_distributed_trains_adapters_like_plain_lightning, "kind")])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_gpipe_distributed_trains_adapters_like_plain_lightning(two_ranks: Path, kind: str) -> None:
    """2 gloo ranks, Lightning's distributed sampler left on (a pipeline is one replica: its ranks read the same
    shuffled order, which the reference reads too), against plain Lightning accumulating the same micro-batches."""
    task, start, base = _start(kind)
    task.load_state_dict(torch.load(two_ranks / f"{kind}.ckpt", weights_only=False)["state_dict"], strict=True)
    assert_frozen_unchanged(base, task.net)
    assert relative_update_difference(start, _pipeline_reference(kind), adapters(task.net)) == 0.0
    state = state_entries(torch.load(two_ranks / f"{kind}.ckpt", weights_only=False)["state_dict"])
    gathered = {type(state[n]).__name__ for n in base}  # as stored: an NF4 weight is not dequantized on the way
    assert gathered == ({"Tensor", "NF4Tensor"} if kind == "nf4" else {"Tensor"})
    from lightning_accel.stored import plain_parts

    for rank in range(2):  # after fit every rank's module is whole, as after DDP, an NF4 weight still NF4
        after = torch.load(two_ranks / f"{kind}-rank{rank}.pt", weights_only=False)
        held = state_entries(after["held"])
        assert set(held) == set(state) and {after["types"][f"net.{n}"] for n in base} == gathered, rank
        for name, value in state.items():
            assert all(torch.equal(a, b) for a, b in zip(held[name], plain_parts(value))), (rank, name)


@pytest.mark.slow
def test_gpipe_distributed_checkpoints_of_a_finetune_gather_the_adapters_only_and_resume_exactly(two_ranks: Path) -> None:
    """Our QLoRA task under 2 gloo ranks: the checkpoint rank 0 gathers holds every stage's adapters and none of the
    base (not gathered: the ranks send their adapters only), records the whole base's hash (each rank hashed it before
    the split), and a fit resumed from half-way ends on the uninterrupted fit's adapters, bit for bit."""
    from lightning_accel.models.finetune_checkpoint import fingerprint, frozen_entries

    full, resumed = (torch.load(two_ranks / f"qlora_{n}.ckpt", weights_only=False) for n in ("full", "resumed"))
    task = qlora_task()
    trainable = {n for n, p in task.named_parameters() if p.requires_grad}
    assert len(trainable) == 16  # q_proj and v_proj of 4 layers, A and B: both stages' adapters
    assert set(full["state_dict"]) == trainable
    assert full["finetune"]["keys"] == sorted(frozen_entries(task))
    assert full["finetune"]["sha256"] == fingerprint(task) is not None
    assert resumed["global_step"] == full["global_step"] == 4
    assert all(torch.equal(resumed["state_dict"][n], full["state_dict"][n]) for n in trainable)
    half = torch.load(two_ranks / "qlora_step2.ckpt", weights_only=False)
    assert not all(torch.equal(half["state_dict"][n], full["state_dict"][n]) for n in trainable)  # it trained past it


@pytest.mark.slow
def test_l2l_offload_ddp_trains_adapters_on_an_nf4_base_like_plain_lightning(tmp_path: Path) -> None:
    """2 gloo ranks, the host step partitioned, Lightning's distributed sampler: each rank's base stays NF4 and
    bit-identical (set-up broadcasts it as its codes and scalers, not dequantized), and the averaged adapters equal
    plain Lightning accumulating over the ranks' shards in turn (the same per-shard bf16 arithmetic)."""
    from tests.support.user_script import start_user_script

    job = start_user_script(WORKERS / "finetune_ddp_worker.py", [str(tmp_path)], 300, "2-process QLoRA")
    try:  # the reference fits while the ranks run
        task, start, _ = _start("nf4")
        dataset = lm_loader().dataset
        shards = [list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
        order = [i for b in range(2) for shard in shards for i in shard[4 * b : 4 * b + 4]]  # rank 0's batch, rank 1's, ...
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, precision="bf16-mixed", accumulate_grad_batches=2,
        )
        trainer.fit(task, DataLoader(dataset, batch_size=4, sampler=order))
    except BaseException:
        job.kill()
        raise
    result = job.result()
    assert result.returncode == 0, result.stdout[-4000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert relative_update_difference(start, adapters(task.net), got["adapters"]) < 1e-5
        assert 0.518 < got["host_bytes_per_param"] < 0.8
