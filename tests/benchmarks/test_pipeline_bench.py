"""The pipeline benchmark on a shrunk workload: every contender runs and the tables are complete."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from lightning_accel.bench import BENCHMARKS
from lightning_accel.benchmarks.pipeline import main
from lightning_accel.models.extras import MissingExtraError


def test_shrunk_benchmark_prints_every_row_and_draws_the_timeline(capsys, tmp_path):
    args = ["--plot", str(tmp_path / "plot"), "--depth", "4", "--hidden", "32", "--batch", "16", "--chunks", "4", "--steps", "1", "--rounds", "1",
            "--memory-chunks", "1,4", "--memory-batch", "64", "--memory-hidden", "64", "--timeout", "120"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("1 process (no pipeline)", "1 process, M=4 micro-batches in turn", "raw torch.distributed.pipelining", "lightning_accel RankPipeline",
                 "lightning_accel GPipeStrategy (2 processes)",
                 "ideal S*M/(M+S-1)", "M=1, checkpoint=never", "M=1, checkpoint=always", "M=4, checkpoint=always"):
        assert name in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert float(rows["ideal S*M/(M+S-1)"][-4]) == pytest.approx(8 / 5, abs=1e-3)  # S=2, M=4
    assert rows["raw torch.distributed.pipelining"][-2:] == ["1.000", "1.000-1.000"]  # vs itself, step by step
    assert "GPipeStrategy in a Trainer vs raw pipelining: " in out and "target >= 0.95x: " in out
    cpu = re.search(r"CPU ms per step on rank 0 / rank 1 .*: raw ([\d.]+) / ([\d.]+); RankPipeline ([\d.]+) / ([\d.]+) "
                    r"\(([\d.]+)x / ([\d.]+)x raw's\); GPipeStrategy ([\d.]+) / ([\d.]+) \(([\d.]+)x / ([\d.]+)x raw's\)", out)
    assert cpu is not None and all(float(v) > 0 for v in cpu.groups())
    assert float(cpu[5]) == pytest.approx(float(cpu[3]) / float(cpu[1]), rel=0.02)  # RankPipeline on rank 0 vs raw there
    assert "where the gap to the ideal 1.60x goes: M=4 micro-batches of 4 rows cost" in out
    assert out.rstrip().splitlines()[-1].startswith("machine: ")
    assert "bubble measured" in out and "fill-drain ideal 20.0%" in out  # (S-1)/(M+S-1) = 1/5
    svg = (tmp_path / "plot" / "pipeline-timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2 * 2 * 4  # 2 stages x (F + B) x 4 micro-batches
    trace = json.loads((tmp_path / "plot" / "pipeline-trace.json").read_text())
    assert sorted({(e["tid"], e["name"]) for e in trace["traceEvents"]}) == sorted(
        (s, f"{k}{m}") for s in range(2) for k in "FB" for m in range(4))


def test_registered_under_pipeline():
    assert BENCHMARKS["pipeline"][1] is main


def test_batch_not_divisible_by_chunks_is_rejected():
    with pytest.raises(SystemExit, match=r"--batch 10 / --chunks 4.*batch divisible by chunks"):
        main(["--batch", "10", "--chunks", "4"])


def test_memory_only_table_peak_falls_with_micro_batches(capsys):
    args = ["--memory-only", "--depth", "8", "--steps", "1", "--memory-chunks", "1,4", "--memory-batch", "256",
            "--memory-hidden", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "raw torch.distributed.pipelining" not in out  # the 2-process part did not run
    peak = {line.split("  ")[0].strip(): float(line.split()[-4]) for line in out.splitlines() if "checkpoint=" in line}
    assert set(peak) == {"M=1, checkpoint=never", "M=1, checkpoint=always", "M=4, checkpoint=always"}
    # one stage checkpointed per micro-batch: backward recomputes a quarter of the batch at a time
    assert peak["M=4, checkpoint=always"] < 0.6 * peak["M=1, checkpoint=always"]
    assert peak["M=4, checkpoint=always"] < 0.6 * peak["M=1, checkpoint=never"]
    assert out.rstrip().splitlines()[-1].startswith("machine: ")


# --model llama: a transformers LlamaForCausalLM, its raw stages cut by hand (benchmarks/pipeline_llama.py)

LLAMA_TINY = ["--model", "llama", "--depth", "4", "--hidden", "64", "--batch", "8", "--seq", "16", "--vocab", "128", "--chunks", "4"]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager: create_causal_mask builds a real mask on each stage
def test_llama_raw_stages_compute_the_models_own_function(attention):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")
    from lightning_accel.benchmarks.pipeline_llama import LlamaStage, build_llama, causal_lm_loss

    net = build_llama(4, 64, 128, 16, torch.float64)
    net.set_attn_implementation(attention)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    first, last = LlamaStage(net, 0, 1), LlamaStage(net, 1, 4)  # uneven on purpose: the rotary/mask recompute per stage
    sent = first(ids)
    assert sent.shape == (4, 16, 64)  # only the hidden states cross ranks
    logits = last(sent.detach().requires_grad_())
    out = net(input_ids=ids, labels=ids)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-10)
    loss = causal_lm_loss(logits, ids)
    # the same loss another way: mean over t < T-1 of -log p(token t+1 | tokens <= t), on the model's own logits
    reference = -torch.log_softmax(out.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-10)
    # the model's own loss: transformers upcasts the logits to float32 for it, so it agrees to float32 rounding
    torch.testing.assert_close(loss.float(), out.loss, rtol=1e-6, atol=0)


def test_llama_stage_outside_the_layers_is_refused():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")
    from lightning_accel.benchmarks.pipeline_llama import LlamaStage, build_llama

    with pytest.raises(ValueError, match=r"stage layers 2\.\.4 are not within the model's 4 decoder layers"):
        LlamaStage(build_llama(4, 64, 128, 16), 2, 5)


@pytest.mark.slow  # 2 subprocess ranks: ~10 s on a quiet 2-core machine, 23 s at load 10
def test_llama_benchmark_runs_every_contender(capsys):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")
    assert main([*LLAMA_TINY, "--steps", "1", "--rounds", "1", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("transformers LlamaForCausalLM (0.2M parameters: 4 layers, hidden 64, vocab 128), batch 8 x 16 tokens; "
                          "2 stages x M=4 micro-batches")
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    for name in ("1 process (no pipeline)", "1 process, M=4 micro-batches in turn", "raw torch.distributed.pipelining",
                 "lightning_accel RankPipeline", "lightning_accel GPipeStrategy (2 processes)"):
        assert float(rows[name][-5]) > 0  # s/step
    assert rows["raw torch.distributed.pipelining"][-2:] == ["1.000", "1.000-1.000"]
    assert float(rows["ideal S*M/(M+S-1)"][-4]) == pytest.approx(8 / 5, abs=1e-3)
    assert "GPipeStrategy in a Trainer vs raw pipelining: " in out and "target >= 0.95x: " in out
    cpu = re.search(r"CPU ms per step on rank 0 / rank 1 .*: raw ([\d.]+) / ([\d.]+); RankPipeline ([\d.]+) / ([\d.]+) "
                    r"\(([\d.]+)x / ([\d.]+)x raw's\); GPipeStrategy ([\d.]+) / ([\d.]+) \(([\d.]+)x / ([\d.]+)x raw's\)", out)
    assert cpu is not None and all(float(v) > 0 for v in cpu.groups())
    assert float(cpu[5]) == pytest.approx(float(cpu[3]) / float(cpu[1]), rel=0.02)  # RankPipeline on rank 0 vs raw there
    assert "M=4 micro-batches of 2 sequences of 16 tokens cost" in out
    assert "checkpoint=" not in out  # the memory table is the MLP's
    assert out.rstrip().splitlines()[-1].startswith("machine: ")


def test_llama_memory_only_is_refused():
    with pytest.raises(SystemExit, match=r"--memory-only measures the MLP; drop --model llama"):
        main(["--model", "llama", "--memory-only"])


def test_llama_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "lightning_accel.benchmarks.pipeline_llama", raising=False)
    with pytest.raises(MissingExtraError, match=r'bench pipeline --model llama needs transformers.*pip install "lightning-accel\[hf\]"'):
        main([*LLAMA_TINY, "--steps", "1"])
