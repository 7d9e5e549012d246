"""One full fine-tune of a transformers Llama whose training state is several times the memory cgroup it may run in
(tests/strategies/test_l2l_tier_cgroup.py).

``python tier_memory_worker.py LAYERS STEPS [NVME_PATH HOST_BUDGET]``: a ``LlamaForCausalLM`` from a ``LlamaConfig``
(:data:`CONFIG` with ``LAYERS`` blocks, random weights) built on the meta device in ``configure_model`` and given its
tensors unit by unit by ``L2LOffloadStrategy``, trained ``STEPS`` steps with AdamW (16 B a parameter in memory: fp32
weight, gradient, two moments); with the NVMe tier under NVME_PATH and ``host_budget`` HOST_BUDGET when given (then also
a checkpoint, last.ckpt in the working directory). Prints the parameter count, the peak RSS, the tier's plan line and
a digest of every weight, so that runs in and out of the cgroup can be compared bit for bit."""

from __future__ import annotations

import hashlib
import resource
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

# blocks of 1.77M parameters (7.1 MB in fp32); the embedding and the untied head 0.79M
CONFIG = {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 1024,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "use_cache": False}


class FineTune(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers

    def configure_model(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        if not hasattr(self, "net"):  # on meta: the strategy materializes it unit by unit, never whole in memory
            with torch.device("meta"):
                self.net = LlamaForCausalLM(LlamaConfig(num_hidden_layers=self.layers, **CONFIG))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def main() -> None:
    layers, steps = int(sys.argv[1]), int(sys.argv[2])
    nvme, budget = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else (None, None)
    torch.manual_seed(0)
    model = FineTune(layers)
    ids = torch.randint(0, CONFIG["vocab_size"], (2 * steps, 16), generator=torch.Generator().manual_seed(1))
    strategy = L2LOffloadStrategy(nvme_path=nvme, host_budget=budget)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=2))
    if nvme:  # a checkpoint of everything, written from the tier's maps: never all of it in memory at once
        trainer.save_checkpoint("last.ckpt")
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plan = strategy._tier_plan.describe() if strategy._tier_plan is not None else "in memory"
    print(f"params={sum(p.numel() for p in model.parameters())} peak_rss={peak} digest={digest.hexdigest()} "
          f"nvme_read={strategy.offload_stats.nvme_read_bytes}\nplan: {plan}", flush=True)


if __name__ == "__main__":
    main()
