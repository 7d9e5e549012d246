"""A litgpt-style Fabric training loop with our strategies swapped in: only the ``strategy=`` argument changes.

    python examples/fabric_litgpt_loop.py --strategy l2l_offload      # blocks streamed from host memory
    python examples/fabric_litgpt_loop.py --strategy gpipe --chunks 2 # micro-batched with recomputation
    python examples/fabric_litgpt_loop.py --strategy auto             # Fabric's own, for comparison
    python examples/fabric_litgpt_loop.py --strategy l2l_offload_ddp --devices 2  # data parallel, host optimizer partitioned
    python examples/fabric_litgpt_loop.py --strategy ddp --devices 2              # Fabric's DDP, for comparison

Runs on the CPU in seconds (a tiny litgpt ``GPT``, random tokens); on a GPU pass ``--accelerator cuda``. The loop is
litgpt's ``finetune/full.py`` loop: accumulation under ``fabric.no_backward_sync``, ``chunked_cross_entropy``,
``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save``; then the trained module generates greedily.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.utils import chunked_cross_entropy

import lightning_accel  # noqa: F401  (registers "l2l_offload" and "gpipe" with Fabric)
from lightning_accel.fabric import GPipeStrategy


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="l2l_offload", choices=["l2l_offload", "l2l_offload_ddp", "gpipe", "auto", "ddp"])
    parser.add_argument("--devices", type=int, default=1, help="processes (l2l_offload_ddp, ddp); each rank its own batches")
    parser.add_argument("--chunks", type=int, default=2, help="gpipe: micro-batches per batch")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true", help="'32-true' or 'bf16-mixed' (l2l_offload keeps fp32 masters)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--out", default="fabric_example.ckpt")
    args = parser.parse_args(argv)

    strategy: Any = GPipeStrategy(chunks=args.chunks) if args.strategy == "gpipe" else args.strategy
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    config = Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=4, n_head=2, n_embd=32)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))

    batches = args.steps * args.accumulation
    tokens = torch.randint(0, config.vocab_size, (batches * fabric.world_size, 4, config.block_size + 1),
                           generator=torch.Generator().manual_seed(0))[fabric.global_rank::fabric.world_size]
    losses = []
    for iter_num, batch in enumerate(tokens, start=1):
        input_ids, targets = fabric.to_device(batch[:, :-1]), fabric.to_device(batch[:, 1:])
        is_accumulating = iter_num % args.accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / args.accumulation)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            fabric.print(f"step {len(losses)}: loss {loss.item():.4f}")
    fabric.save(Path(args.out), {"model": model, "optimizer": optimizer, "iter_num": iter_num})

    model.eval()
    with torch.no_grad():  # the module after the loop: inference, greedy
        ids = tokens[0, :1, :4].to(fabric.device)
        for _ in range(4):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    fabric.print(f"generated: {ids[0].tolist()}")
    return losses


if __name__ == "__main__":
    main()
