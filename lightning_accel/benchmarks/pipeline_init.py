"""``lightning-accel bench pipeline-init``: peak host memory per rank, a network built whole on every rank against built on meta.

A ``LightningModule`` that builds a random-init transformers ``LlamaForCausalLM`` (float32) in
``configure_model`` is trained for one step by ``DistributedGPipeStrategy`` on 2 gloo
processes, twice: ``deferred_init=False`` (every rank builds and initializes the whole
model, then frees the other stage's blocks, as for a network built in ``__init__``) and the
deferred, ``deferred_init="parts"`` (built on ``meta``; each rank materializes only its stage and what is
outside the blocks; the default ``deferred_init=True`` builds the whole once more for the user's own starting values
where it fits). Each rank reports its peak resident memory (``ru_maxrss``) at three
points: after imports (the interpreter, torch, Lightning and transformers), after setup
(the model placed; optimizer not stepped yet) and after the first step (gradients and AdamW
state of the rank's own parameters), and the seconds from before ``configure_model`` to the
end of setup. Each run is a fresh pair of processes, so one
run's peak does not hide the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_accel.bench import format_table, machine_line, register_benchmark

_MIB = 1024  # ru_maxrss is in KiB on Linux


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _MIB


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench pipeline-init", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="decoder layers (default 24)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size; heads of 64, Llama's MLP ratio (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000, Llama 2's)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence of the one training batch (default 32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each 2-process run may take (default 300)")
    p.add_argument("--worker", choices=["whole", "deferred"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _worker(args: argparse.Namespace) -> int:
    """One rank of one run (Lightning's launcher starts the other from this same command line)."""
    after_imports = _peak_mib()
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accel.models.extras import import_extra
    from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

    transformers = import_extra("transformers", "hf", "bench pipeline-init")
    after_imports = max(after_imports, _peak_mib())
    heads = max(1, args.hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=8 * round(args.hidden * 2.6875 / 8),
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=args.seq, use_cache=False,
    )
    marks: dict[str, Any] = {"after_imports": after_imports}

    class Llama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.net is None:
                self.net = transformers.LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(input_ids=batch[0], labels=batch[0]).loss  # type: ignore[misc]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Marks(pl.Callback):
        def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
            marks["t0"] = time.perf_counter()  # before configure_model

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            marks["after_setup"] = _peak_mib()
            marks["held"] = sum(p.numel() for p in module.parameters() if not p.is_meta)
            marks["total"] = sum(p.numel() for p in module.parameters())
            marks["t_setup"] = time.perf_counter() - marks.pop("t0")  # configure_model and the strategy's setup

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            marks["after_step"] = _peak_mib()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens = torch.randint(0, args.vocab, (2, args.seq))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[Marks()],
        strategy=DistributedGPipeStrategy(chunks=2, deferred_init="parts" if args.worker == "deferred" else False, timeout=args.timeout),
    )
    trainer.fit(Llama(), DataLoader(TensorDataset(tokens), batch_size=2))
    rank = trainer.global_rank
    Path(args.out, f"{args.worker}-rank{rank}.json").write_text(json.dumps(marks))
    return 0


def _run(mode: str, args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "lightning_accel.benchmarks.pipeline_init", "--worker", mode, "--out", out]
    command += [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--vocab={args.vocab}", f"--seq={args.seq}"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode:
        raise RuntimeError(f"bench pipeline-init: the {mode} run failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return [json.loads(Path(out, f"{mode}-rank{r}.json").read_text()) for r in range(2)]


@register_benchmark("pipeline-init", "peak host memory per rank: gpipe_distributed building the whole model vs deferred")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        runs = {mode: _run(mode, args, out) for mode in ("whole", "deferred")}
    total = runs["whole"][0]["total"]
    for mode, ranks in runs.items():
        for r, m in enumerate(ranks):
            rows.append((
                "built whole on every rank" if mode == "whole" else "deferred (meta, own part)", r,
                f"{m['held'] / 1e6:.0f}M", round(m["after_imports"]), round(m["after_setup"]), round(m["after_step"]),
                f"{m['t_setup']:.1f}",
            ))
    print(
        f"gpipe_distributed on 2 gloo ranks, LlamaForCausalLM {args.layers} layers x {args.hidden}, vocab {args.vocab}: "
        f"{total / 1e6:.0f}M parameters, float32 ({total * 4 / 2**20:.0f} MiB); peak RSS (ru_maxrss) per rank in MiB"
    )
    print(format_table(
        ["build", "rank", "params held", "after imports", "after setup", "after step 1", "setup s"], rows
    ))
    for r in range(2):
        whole, deferred = runs["whole"][r]["after_setup"], runs["deferred"][r]["after_setup"]
        print(f"rank {r}: deferred setup peak {deferred:.0f} MiB vs {whole:.0f} MiB built whole ({deferred / whole:.2f}x)")
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
