"""The host memory a pretrained load costs, measured: ``PeakRSS`` against allocations of known size, and
``hf_causal_lm``'s record of a save_pretrained directory loaded in bf16 (no fp32 copy: well under 1.3x the weights'
stored size) and in fp32 (the fp32 copy shows). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_accel.host_memory import PeakRSS
from lightning_accel.models import load_peak

MIB = 2**20


def test_peak_rss_counts_what_the_code_added_at_its_peak_not_what_came_before() -> None:
    before = torch.ones(64 * MIB // 4)  # held before: not the code's
    del before
    with PeakRSS() as peak:
        held = torch.ones(96 * MIB // 4)
        held.add_(1)
        del held
    if peak.added is None:
        pytest.skip("no /proc/self/clear_refs here: the peak is not measurable")
    assert 90 * MIB <= peak.added <= 140 * MIB


@pytest.fixture(scope="module")
def bf16_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("bf16")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)  # 21M parameters, 42 MB
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_pretrained_load_records_its_peak_against_the_stored_size(bf16_directory: Path, dtype: str) -> None:
    from lightning_accel.models.hf import hf_causal_lm

    model = hf_causal_lm(pretrained_path=str(bf16_directory), dtype=dtype)
    peak = load_peak.find(torch.nn.Sequential(model))  # found inside a wrapper, as a task or peft holds it
    assert peak is not None and peak.path == str(bf16_directory)
    tensors = [*model.parameters(), *model.buffers()]  # the head is tied to the embedding: counted once
    assert peak.stored == sum(t.numel() * t.element_size() for t in tensors)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    if peak.added is None:
        pytest.skip("no /proc/self/clear_refs here: the peak is not measurable")
    if dtype == "bfloat16":
        assert peak.added <= 1.3 * peak.stored  # no fp32 copy of the model on the way
    else:
        assert peak.added >= 0.9 * peak.stored  # the fp32 weights are new memory: the measurement sees them
    assert peak.describe().startswith(f"pretrained weights from {bf16_directory} loaded at a peak of +")
