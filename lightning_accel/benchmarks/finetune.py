"""``lightning-accel bench finetune``: LoRA and QLoRA fine-tuning under our strategies against plain Lightning.

Every contender fine-tunes the same transformers Llama (random weights, loaded in bf16 as ``from_pretrained(dtype=
torch.bfloat16)`` gives them, its base frozen, peft LoRA on q_proj/v_proj) on the same tokens for the same steps in
this process, one after another, in ``bf16-mixed``. The QLoRA rows turn the blocks' Linear weights into torchao NF4
first (block 64, double-quantized scalers, as QLoRA and torchtune). Columns:

- step time against plain Lightning with the same base (median of interleaved rounds);
- host bytes per offloaded parameter (L2L: everything the host keeps for the blocks, frozen weights at their stored
  size; targets: <= 2.1 for a bf16 base, <= 0.65 for NF4);
- bus bytes per step (L2L: weights to the device and gradients back);
- the adapters' update against plain Lightning's from the same start (relative L2 distance; a pipeline against plain
  Lightning accumulating over the same micro-batches, the arithmetic it reproduces);
- whether the frozen base is bit-identical after fit (its NF4 type too).

Below the table, the per-block arithmetic of a 70B Llama in NF4 under L2L: bytes a block puts on the bus per step and
the compute it hides behind, at ``--tokens`` a step, for a bus and a device speed given on the command line (on a CUDA
machine the pinned copy bandwidth is measured).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.benchmarks.offload_workload import StepTimer, pinned_bandwidth_gbs
from lightning_accel.models.extras import import_extra
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.stored import plain_parts
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class _CausalLM(pl.LightningModule):
    """Next-token cross-entropy over the net's logits; AdamW over every parameter (the frozen ones get no gradient)."""

    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _base(args: argparse.Namespace, nf4: bool) -> nn.Module:
    transformers = import_extra("transformers", "hf", "bench finetune")
    peft = import_extra("peft", "finetune", "bench finetune")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=args.width // 64, num_key_value_heads=args.width // 64, max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if nf4:
        import_extra("torchao", "finetune", "bench finetune")
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in f".{name}":
                module.weight = nn.Parameter(to_nf4(module.weight.data, 64, 256), requires_grad=False)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def _data(args: argparse.Namespace, batch: int) -> DataLoader:
    tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def _adapters(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().float().clone() for n, p in net.named_parameters() if p.requires_grad}


def _frozen(net: nn.Module) -> dict[str, tuple[type, list[Tensor]]]:
    return {n: (type(p), [t.detach().clone() for t in plain_parts(p)]) for n, p in net.named_parameters() if not p.requires_grad}


def _same(before: dict[str, tuple[type, list[Tensor]]], after: dict[str, tuple[type, list[Tensor]]]) -> bool:
    return all(after[n][0] is k and all(torch.equal(a, b) for a, b in zip(after[n][1], parts)) for n, (k, parts) in before.items())


def _fit(start: nn.Module, args: argparse.Namespace, strategy: Any, micro_batch: int | None = None, **kwargs: Any) -> dict[str, Any]:
    task = _CausalLM(copy.deepcopy(start), args.lr)
    timer = StepTimer(args.warmup)
    accumulate = args.batch // micro_batch if micro_batch else 1
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1, strategy=strategy, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], accumulate_grad_batches=accumulate, **kwargs,
    )
    trainer.fit(task, _data(args, micro_batch or args.batch))
    stats = getattr(trainer.strategy, "offload_stats", None)
    return {"times": timer.times, "adapters": _adapters(task.net), "frozen": _frozen(task.net), "stats": stats}


def _relative(start: dict[str, Tensor], reference: dict[str, Tensor], other: dict[str, Tensor]) -> float:
    diff = sum(((other[k] - reference[k]) ** 2).sum() for k in reference) ** 0.5
    return float(diff / sum(((reference[k] - start[k]) ** 2).sum() for k in reference) ** 0.5)


def _contenders(args: argparse.Namespace) -> dict[str, tuple[str, Any, dict[str, Any]]]:
    """name -> (base, strategy factory, Trainer keywords); the first row of each base is its plain reference."""
    bf16 = {"precision": "bf16-mixed"}
    offload = {"plugins": [OffloadPrecision("bf16-mixed")]}
    return {
        "plain Lightning, LoRA": ("bf16", lambda: "auto", bf16),
        "l2l_offload, LoRA": ("bf16", L2LOffloadStrategy, offload),
        "gpipe 2 stages x 2, LoRA": ("bf16", lambda: GPipeStrategy(devices=2, chunks=2), bf16),
        "plain Lightning, QLoRA": ("nf4", lambda: "auto", bf16),
        "l2l_offload, QLoRA": ("nf4", L2LOffloadStrategy, offload),
    }


def finetune_table(args: argparse.Namespace) -> str:
    starts = {"bf16": _base(args, nf4=False), "nf4": _base(args, nf4=True)}
    contenders = _contenders(args)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    last: dict[str, dict[str, Any]] = {}
    _fit(starts["nf4"], args, "auto", precision="bf16-mixed")  # discarded: the first fit in a process pays kernel set-up
    for _ in range(args.rounds):  # interleaved: a noisy neighbour hits every contender alike
        for name, (base, strategy, kwargs) in contenders.items():
            got = _fit(starts[base], args, strategy(), **kwargs)
            times[name].extend(got["times"])
            last[name] = got
    # the pipeline's arithmetic: plain Lightning accumulating over the same micro-batches
    same_micro = _fit(starts["bf16"], args, "auto", micro_batch=args.batch // 2, precision="bf16-mixed")
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    rows = []
    for name, (base, _, _) in contenders.items():
        plain = f"plain Lightning, {'QLoRA' if base == 'nf4' else 'LoRA'}"
        reference = same_micro if name.startswith("gpipe") else last[plain]
        stats = last[name]["stats"]
        start = _adapters(starts[base])
        update = f"{_relative(start, reference['adapters'], last[name]['adapters']):.1e}" if name != plain else "(reference)"
        rows.append([
            name, f"{median[name]:.3f}", f"{median[name] / median[plain]:.2f}",
            f"{stats.host_bytes_per_param:.2f}" if stats else "-",
            f"{(stats.h2d_bytes_per_step + stats.d2h_bytes_per_step) / 2**20:.1f}" if stats else "-",
            update + (" (same micro-batches)" if name.startswith("gpipe") else ""),
            "yes" if _same(_frozen(starts[base]), last[name]["frozen"]) else "NO",
        ])
    trainable = sum(p.numel() for p in starts["bf16"].parameters() if p.requires_grad)
    total = sum(p.numel() for p in starts["bf16"].parameters())
    title = (
        f"transformers Llama {args.layers} x {args.width} ({total / 1e6:.1f}M params, LoRA r={args.rank} on q/v: "
        f"{trainable / total:.2%} trainable), bf16 base, batch {args.batch}x{args.seq}, bf16-mixed, {args.rounds} "
        f"interleaved rounds of {args.steps} steps; targets: host B/param <= 2.1 (bf16) / 0.65 (NF4), update within 1e-2"
    )
    header = ["contender", "step s (median)", "x plain", "host B/param", "bus MiB/step", "update vs plain", "base bit-identical"]
    return title + "\n" + format_table(header, rows)


# Llama 3.1 70B, one decoder block: q/o 8192x8192, k/v 8192x1024, gate/up/down 8192x28672
_BLOCK_70B = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
_NF4_BYTES = 0.516  # torchao NF4 a parameter (4-bit codes, a bf16 scaler per 64 quantized to 8 bits per 256)


def arithmetic_table(args: argparse.Namespace, bus_gbs: float) -> str:
    """Per block of a 70B Llama under L2L, at ``args.tokens`` a step: the bytes on the bus (fetched for the forward and
    again for the recomputation and backward) against the compute they overlap (forward, recomputed forward, backward
    of the inputs; the frozen weights get no weight gradient), for the base in bf16 and in NF4."""
    flops = 2 * _BLOCK_70B * args.tokens * 3  # matmul FLOPs: forward + recompute + input-gradient backward
    compute_ms = flops / (args.tflops * 1e12) * 1e3
    rows = []
    for base, per_param in (("bf16", 2.0), ("NF4", _NF4_BYTES)):
        nbytes = 2 * _BLOCK_70B * per_param
        bus_ms = nbytes / (bus_gbs * 1e9) * 1e3
        rows.append([base, f"{_BLOCK_70B / 1e6:.0f}M", f"{nbytes / 2**30:.2f}", f"{bus_ms:.0f}", f"{compute_ms:.0f}",
                     f"{bus_ms / compute_ms:.2f}", "hidden" if bus_ms < compute_ms else "bus-bound"])
    header = ["70B base", "params/block", "GiB on bus/step", "bus ms", "compute ms", "bus/compute", "verdict"]
    return (f"by arithmetic: one 70B block at {args.tokens} tokens a step, bus {bus_gbs:.1f} GB/s, device {args.tflops:g} "
            "TFLOP/s sustained (attention FLOPs left out: they only add compute)\n" + format_table(header, rows))


@register_benchmark("finetune", "LoRA/QLoRA under l2l_offload and gpipe vs plain Lightning: time, host bytes, update, base")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-accel bench finetune")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512, help="hidden size (a multiple of 64: heads of 64)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8, help="LoRA r")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a step in the 70B arithmetic")
    parser.add_argument("--bus-gbs", type=float, default=None, help="host-to-device GB/s (default: measured on CUDA, else 25, PCIe 4 x16)")
    parser.add_argument("--tflops", type=float, default=150.0, help="sustained bf16 TFLOP/s of the device (default 150: a 24 GB card)")
    args = parser.parse_args(argv)
    for flag in ("layers", "rank", "steps", "rounds", "tokens"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be > 0, got {getattr(args, flag)}")
    if args.width % 64 or args.width <= 0:
        parser.error(f"--width must be a positive multiple of 64 (heads of 64), got {args.width}; e.g. --width 512")
    if args.batch % 2:
        parser.error(f"--batch must be even (the gpipe row splits it into 2 micro-batches), got {args.batch}")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (steps after the warm-up are timed)")
    print(finetune_table(args))
    bus = args.bus_gbs
    if bus is None:
        bus = pinned_bandwidth_gbs() if torch.cuda.is_available() else 25.0
    print(arithmetic_table(args, bus))
    print(machine_line())
    return 0
