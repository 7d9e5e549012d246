"""One L2L fit of a model whose host state is larger than the memory cgroup it may run in (tests/strategies/test_l2l_tier_cgroup.py).

``python tier_memory_worker.py WIDTH DEPTH STEPS [NVME_PATH]``: blocks of ``WIDTH x WIDTH`` Linears (fp32, AdamW: 16 B a
parameter in memory), ``STEPS`` steps, with the NVMe tier under NVME_PATH when given (and then a checkpoint, last.ckpt in
the working directory); prints the peak RSS and a digest of every weight, so that runs in and out of the cgroup can be
compared bit for bit."""

from __future__ import annotations

import hashlib
import resource
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Deep(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    width, depth, steps = (int(a) for a in sys.argv[1:4])
    nvme = sys.argv[4] if len(sys.argv) > 4 else None
    torch.manual_seed(0)
    model = Deep(width, depth)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x.flip(1)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(nvme_path=nvme), max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    if nvme:  # a checkpoint of everything, written from the tier's maps: never all of it in memory at once
        trainer.save_checkpoint("last.ckpt")
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak_rss={peak} digest={digest.hexdigest()} nvme_read={trainer.strategy.offload_stats.nvme_read_bytes}", flush=True)


if __name__ == "__main__":
    main()
