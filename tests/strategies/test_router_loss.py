"""A mixture-of-experts model's router load-balancing loss under ``gpipe``: per micro-batch, as Megatron computes it, so
a step equals plain Lightning accumulating the same micro-batches (not one whole-batch step), and the strategy says so
once. A tiny transformers Mixtral, random weights, ``output_router_logits=True``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import GPipeStrategy
from lightning_accel.models.router_loss import router_loss_notice

transformers = pytest.importorskip("transformers", reason="needs the hf extra")


def mixtral(router_logits: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_logits, router_aux_loss_coef=0.5,
        max_position_embeddings=32))


class CausalLM(pl.LightningModule):
    """The model's own loss (cross-entropy plus the router's), as a user with ``labels`` writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mixtral()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(strategy, batch_size: int, accumulate: int) -> dict[str, torch.Tensor]:
    task = CausalLM()
    tokens = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, accumulate_grad_batches=accumulate, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               ).fit(task, DataLoader(TensorDataset(tokens), batch_size=batch_size))
    return task.net.state_dict()


def test_gpipe_computes_the_router_loss_per_micro_batch_and_says_so_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        piped = train(GPipeStrategy(devices=2, chunks=2), batch_size=8, accumulate=1)
    said = [str(w.message) for w in caught if "output_router_logits" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("GPipeStrategy(chunks=2): MixtralConfig.output_router_logits=True")
    accumulated = train("auto", batch_size=4, accumulate=2)  # the documented convention: the same micro-batches
    whole = train("auto", batch_size=8, accumulate=1)
    for name, tensor in accumulated.items():
        torch.testing.assert_close(piped[name], tensor, rtol=1e-5, atol=1e-6, msg=name)  # measured: 0.0
    assert max(float((whole[n] - piped[n]).abs().max()) for n in whole) > 1e-3  # a whole-batch step differs (3.6e-2)


def test_the_notice_names_only_a_router_loss_under_micro_batches() -> None:
    assert router_loss_notice("GPipeStrategy", mixtral(), chunks=1) is None  # the whole batch: nothing to say
    assert router_loss_notice("GPipeStrategy", mixtral(router_logits=False), chunks=4) is None
    assert "accumulating 4 micro-batches" in router_loss_notice("GPipeStrategy", mixtral(), chunks=4)


def test_l2l_offload_keeps_the_whole_batch_router_loss() -> None:
    """L2L runs each batch whole (blocks streamed, nothing micro-batched): the router loss is plain Lightning's own."""
    from lightning_accel import L2LOffloadStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded = train(L2LOffloadStrategy(), batch_size=8, accumulate=1)
    assert not [w for w in caught if "output_router_logits" in str(w.message)]  # nothing to say: no micro-batches
    for name, tensor in train("auto", batch_size=8, accumulate=1).items():
        torch.testing.assert_close(offloaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
