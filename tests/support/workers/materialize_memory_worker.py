"""A save_pretrained model larger than the memory cgroup it is loaded in (tests/strategies/test_l2l_materialize_cgroup.py).

``python materialize_memory_worker.py save DIR``: a Llama (:data:`CONFIG`), written in bf16 with save_pretrained;
``... load DIR``: loaded whole in memory in fp32 (``hf_causal_lm(pretrained_path=DIR)``: every weight cast, so none
stays a map of the file), as a run without ``load_by_block`` does;
``... by_block DIR NVME_PATH``: loaded with ``load_by_block=True`` and fit for one step under L2L with the NVMe tier.
Each prints its peak RSS; ``by_block`` also what was materialized where."""

from __future__ import annotations

import resource
import sys

import torch

# 16 blocks of 3.4M parameters (55M: 0.22 GB in fp32, saved in bf16 as the hub's checkpoints are); one block 13.6 MB
CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 16,
          "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024, "use_cache": False, "tie_word_embeddings": True}


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    from lightning_accel.models.hf import hf_causal_lm

    if mode == "save":
        torch.manual_seed(0)
        hf_causal_lm(CONFIG, dtype="bfloat16").save_pretrained(path)
    elif mode == "load":
        model = hf_causal_lm(pretrained_path=path)
        print(f"loaded {sum(p.numel() for p in model.parameters())} parameters", flush=True)
    else:
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader, TensorDataset

        from lightning_accel.models import LanguageModelTask
        from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

        tokens = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(0))
        task = LanguageModelTask(hf_causal_lm(pretrained_path=path, load_by_block=True),
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
        # the blocks step as their gradients arrive, so no more than a few blocks' gradients are held at once
        strategy = L2LOffloadStrategy(nvme_path=sys.argv[3], overlap_step=True)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(task, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
        done = strategy._materialized
        print(f"staged={done.staged_bytes} peak_new={done.peak_bytes} nvme_read={strategy.offload_stats.nvme_read_bytes}", flush=True)
    print(f"peak_rss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)


if __name__ == "__main__":
    main()
