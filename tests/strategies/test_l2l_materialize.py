"""A model built on meta under L2LOffloadStrategy: from a save_pretrained directory (``hf_causal_lm(load_by_block=True)``)
or in ``configure_model``, materialized unit by unit; with the NVMe tier it is never in host memory whole, and a fit
equals the same fit of the model loaded normally, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

from lightning_accel.models import LanguageModelTask  # noqa: E402
from lightning_accel.models.hf import hf_causal_lm  # noqa: E402
from lightning_accel.plugins.precision import OffloadPrecision  # noqa: E402
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "use_cache": False, "tie_word_embeddings": True}


class Task(LanguageModelTask):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def _data() -> DataLoader:
    tokens = torch.randint(0, 128, (16, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def _fit(module: pl.LightningModule, strategy: L2LOffloadStrategy, steps: int = 3, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator=kwargs.pop("accelerator", "cpu"), devices=1, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=steps,
                         **kwargs)
    trainer.fit(module, _data())
    return trainer


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    hf_causal_lm(LLAMA).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("budget", [None, 4_000_000], ids=["all-on-disk", "some-blocks-in-memory"])
def test_a_pretrained_model_loaded_by_block_under_the_tier_trains_as_the_model_loaded_in_memory(
        saved: Path, tmp_path: Path, budget: int | None, caplog: pytest.LogCaptureFixture) -> None:
    reference = Task(hf_causal_lm(pretrained_path=str(saved)))
    _fit(reference, L2LOffloadStrategy())
    net = hf_causal_lm(pretrained_path=str(saved), load_by_block=True)
    assert all(p.is_meta for p in net.parameters())  # nothing read yet
    model_bytes = _bytes(net)
    module = Task(net)
    with caplog.at_level("INFO"):
        trainer = _fit(module, L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme"), host_budget=budget))
    done = trainer.strategy._materialized
    spilled = trainer.strategy._tier_plan.disk_bytes
    assert spilled > 0 and (budget is None or done.in_memory_bytes > model_bytes // 4)  # (blocks settled in memory)
    # the staged blocks never all in memory: at most the resident unit and one block being filled at once
    assert done.staged_bytes > model_bytes // 2 and done.peak_bytes < model_bytes // 2, (done, model_bytes)
    assert "materialized from meta block by block" in caplog.text
    assert trainer.strategy.offload_stats.nvme_read_bytes > 0
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
    assert module.net.lm_head.weight is module.net.model.embed_tokens.weight  # still tied


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_model_loaded_by_block_trains_in_bf16_as_the_model_loaded_in_memory(saved: Path, tmp_path: Path) -> None:
    reference = Task(hf_causal_lm(pretrained_path=str(saved)))
    _fit(reference, L2LOffloadStrategy(), accelerator="gpu", plugins=[OffloadPrecision("bf16-mixed")])
    module = Task(hf_causal_lm(pretrained_path=str(saved), load_by_block=True))
    trainer = _fit(module, L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme")), accelerator="gpu",
                   plugins=[OffloadPrecision("bf16-mixed")])
    assert trainer.strategy.offload_stats.nvme_read_bytes > 0
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name].cpu(), value.cpu()), name


class ConfigureModel(pl.LightningModule):
    """Lightning's large-model hook: the network built in configure_model, on meta (``trainer.init_module`` or a
    device context inside the hook)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        if self.how == "meta":
            with torch.device("meta"):
                self.net = _stack()
        elif self.how == "cpu":
            self.net = _stack()
        else:
            with torch.device("meta"):
                self.net = nn.Sequential(_Scaled(), *_stack())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.net is not None
        return nn.functional.mse_loss(self.net(x.float()), y.float())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _stack() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(4)])


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # no reset_parameters: nothing could initialize it on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _vectors() -> DataLoader:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.flip(1)), batch_size=4)


def test_a_network_built_on_meta_in_configure_model_gets_reset_parameters_and_trains_as_built_on_the_cpu(tmp_path: Path) -> None:
    runs = {}
    for how, nvme in (("cpu", None), ("meta", str(tmp_path))):
        torch.manual_seed(0)
        module = ConfigureModel(how)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(nvme_path=nvme), logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=2)
        trainer.fit(module, _vectors())
        runs[how] = module.state_dict()
    assert runs["cpu"].keys() == runs["meta"].keys()
    for name, value in runs["cpu"].items():
        assert torch.equal(runs["meta"][name], value), name


def test_a_meta_tensor_nothing_can_initialize_is_refused_before_any_work(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(nvme_path=str(tmp_path)), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1)
    with pytest.raises(ValueError, match=r"parameter net\.0\.scale is on the meta device and _Scaled has no reset_parameters"):
        trainer.fit(ConfigureModel("unfillable"), _vectors())
    assert not any(tmp_path.iterdir())  # refused before a staging file was made


def test_init_module_empty_init_builds_on_meta() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(), logger=False)
    with trainer.init_module(empty_init=True):
        assert nn.Linear(2, 2).weight.is_meta
    with trainer.init_module():
        assert not nn.Linear(2, 2).weight.is_meta
