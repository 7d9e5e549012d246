"""Fine-tune runs end to end, through ``lightning-accel`` in a subprocess like a user: a tiny Llama written with
save_pretrained is fine-tuned from ``model.net.pretrained_path``, ``lightning-accel export`` writes its adapters, and
peft's ``PeftModel.from_pretrained`` on the plain base (for QLoRA: the same base in NF4) gives the trained model's
logits; a killed fine-tune resumes to the adapters of an uninterrupted one; the output holds our lines, not our
dependencies' import noise. Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers", reason="needs the hf extra")
peft = pytest.importorskip("peft", reason="needs the finetune extra")
pytest.importorskip("torchao", reason="needs the finetune extra")

from lightning_accel import cli  # noqa: E402
from lightning_accel.models.quantize import quantize_nf4  # noqa: E402

TESTS = Path(__file__).parent
SHORT = ["trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2", "data.block_size=32",
         "data.batch_size=4", "data.max_bytes=300000", "trainer.enable_progress_bar=false", "model.optimizer.lr=1e-2"]
NOISE = ("Failed to load", "is an Enum subclass", "is_gradient_checkpointing", "Traceback")


def with_tests_path(env: dict[str, str]) -> dict[str, str]:
    return env | {"PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])}


def run_dirs(outputs: Path, recipe: str) -> list[Path]:
    return sorted(p.parent for p in (outputs / recipe).glob("*/run.json"))


def save_base(path: Path) -> None:
    """A Llama for the byte corpus, every block Linear a multiple of 64 x 256 elements (NF4-able)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      tie_word_embeddings=True, use_cache=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def load_base(path: Path, nf4: bool) -> torch.nn.Module:
    base = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    if nf4:
        quantize_nf4(base)  # the same NF4 base the run trained on (model/adapter=qlora's defaults)
    return base


def merged_reference(base_dir: Path, checkpoint: Path, nf4: bool) -> torch.nn.Module:
    """The trained model computed another way: the base (its NF4 weights dequantized) with each adapter merged
    by hand, W + alpha / r * B @ A, read from the run's checkpoint: no peft involved."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    record = state["finetune"]["adapter"]
    scale = record["lora_alpha"] / record["r"]
    reference = load_base(base_dir, nf4)
    for name, module in list(reference.named_modules()):
        if isinstance(module, torch.nn.Linear) and hasattr(module.weight, "get_original_weight"):
            module.weight = torch.nn.Parameter(module.weight.get_original_weight().float(), requires_grad=False)
    merged = 0
    for key, a in state["state_dict"].items():
        if ".lora_A." not in key:
            continue
        b = state["state_dict"][key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix("net.base_model.model.").split(".lora_A.")[0]
        weight = reference.get_submodule(module).weight
        weight.data += scale * (b @ a)
        merged += 1
    assert merged == 4  # q_proj and v_proj of 2 layers
    return reference


def check_export(run_dir: Path, base_dir: Path, out: Path, nf4: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """``lightning-accel export`` of ``run_dir`` loads in peft on the plain base and gives the logits of the run's
    adapters merged by hand into that base."""
    status = json.loads((run_dir / "run.json").read_text())
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    exported = peft.PeftModel.from_pretrained(load_base(base_dir, nf4), out).eval()
    assert exported.peft_config["default"].base_model_name_or_path == str(base_dir)

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = exported(x).logits
        want = merged_reference(base_dir, Path(status["checkpoint"]), nf4)(x).logits
        untrained = load_base(base_dir, nf4)(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - untrained).abs().max() > 1e-2  # the adapters trained: the test can fail


def completed(outputs: Path, recipe: str, steps: int) -> Path:
    (run_dir,) = run_dirs(outputs, recipe)
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "completed" and status["global_step"] == steps, status
    return run_dir


LORA = ["llama-tiny_lora_cpu", *SHORT, "trainer.max_steps=8", "trainer.val_check_interval=4",
        "model.adapter.dropout=0.1"]  # dropout on: the RNG has to continue too
KILL = ["+callbacks.kill._target_=kill_at_step.KillAtStep", "+callbacks.kill.step=6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_cli_env: Any, cli_processes: Any) -> tuple[Path, dict[str, Any]]:
    """The command-line runs this file checks, side by side (each is mostly importing Lightning, on one core):
    a LoRA fine-tune of a save_pretrained base uninterrupted (``ref``), killed at step 6 (``killed``) and resumed
    (``resumed``, outputs under ``crashed``), a QLoRA one under l2l_offload (``qlora``), and ``validate`` of the QLoRA
    recipe in a fresh process; the root directory holds the base (``base``) and each job's outputs."""
    root = tmp_path_factory.mktemp("export")
    save_base(root / "base")
    base = [f"model.net.pretrained_path={root / 'base'}"]  # alone: its config.json replaces the recipe's model.net.config
    lora = [LORA[0], *base, *LORA[1:]]
    jobs = {
        "killed": cli_processes.job(["run", *lora, *KILL], with_tests_path(make_cli_env(root / "crashed"))),
        "resumed": cli_processes.job(["run", *lora, "ckpt_path=last"], with_tests_path(make_cli_env(root / "crashed")), after="killed"),
        "qlora": cli_processes.job(["run", "llama-tiny_qlora_cpu", *base, *SHORT, "strategy=l2l_offload", "precision=offload-32-true",
                                    "callbacks=offload"], make_cli_env(root / "qlora")),
        # a fresh process: torchao (imported by transformers and peft) logs its import lines once per process; cli.main
        # drops them before any command, so a raw import would show 4 of them
        "validate": cli_processes.job(["validate", "llama-tiny_qlora_cpu"], make_cli_env(root / "validate")),
        "ref": cli_processes.job(["run", *lora], make_cli_env(root / "ref")),
    }
    return root, cli_processes.side_by_side(jobs)


@pytest.mark.slow
def test_a_lora_finetune_exports_to_peft_and_a_killed_one_resumes_to_its_adapters(runs: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A save_pretrained base fine-tuned through the command line is exported and reloaded with peft; the same fine-tune
    killed at step 6 and resumed with ckpt_path=last ends on the uninterrupted one's adapters, bit for bit."""
    root, done = runs
    reference, killed, resumed = done["ref"], done["killed"], done["resumed"]
    assert reference.returncode == 0, reference.stderr[-3000:]
    for noise in NOISE:
        assert noise not in reference.stdout + reference.stderr, noise
    assert f"pretrained weights from {root / 'base'} loaded at a peak of +" in reference.stdout + reference.stderr
    reference_dir = completed(root / "ref", "llama-tiny_lora_cpu", 8)
    check_export(reference_dir, root / "base", tmp_path / "adapter", nf4=False, capsys=capsys)

    assert killed.returncode == -9, killed.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr

    def final(run_dir: Path) -> dict[str, torch.Tensor]:
        status = json.loads((run_dir / "run.json").read_text())
        return torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]

    want = final(reference_dir)
    got = final(sorted(p.parent for p in (root / "crashed" / "llama-tiny_lora_cpu").glob("*/run.json"))[-1])
    assert got.keys() == want.keys() and all(".lora_" in k for k in want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_a_qlora_finetune_under_l2l_offload_exports_to_peft_on_the_nf4_base(runs: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    root, done = runs
    ran = done["qlora"]
    assert ran.returncode == 0, ran.stderr[-3000:]
    for noise in NOISE:
        assert noise not in ran.stdout + ran.stderr, noise
    run_dir = completed(root / "qlora", "llama-tiny_qlora_cpu", 12)
    check_export(run_dir, root / "base", tmp_path / "adapter", nf4=True, capsys=capsys)


def _fake_run(run_dir: Path, recipe: str, checkpoint: bool, overrides: list[str] | None = None) -> Path:
    from lightning_accel.config.compose import compose_recipe

    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_recipe(recipe, overrides or []), run_dir / ".hydra" / "config.yaml")
    status = {"status": "killed"}
    if checkpoint:
        (run_dir / "checkpoints").mkdir()
        torch.save({"state_dict": {}}, run_dir / "checkpoints" / "last.ckpt")
        status = {"status": "completed", "checkpoint": str(run_dir / "checkpoints" / "last.ckpt")}
    (run_dir / "run.json").write_text(json.dumps(status))
    return run_dir


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d.mkdir(), r"'.*/run' has no run\.json: not a run directory; pass one that `lightning-accel run` made"),
        (lambda d: _fake_run(d, "llama-tiny_lora_cpu", checkpoint=False),
         r"'.*/run' has no checkpoint: run.json names none, and .*/run/checkpoints holds no .ckpt; export a run whose checkpoint is there"),
        (lambda d: _fake_run(d, "llama-tiny_cpu", checkpoint=True),
         r"'.*/run' trained without an adapter \(model\.adapter is null\): its checkpoint holds the whole model, no adapters to export"),
        (lambda d: _fake_run(d, "llama-tiny_lora_cpu", checkpoint=True),
         r"'.*/last\.ckpt' has no record of a frozen base"),
    ],
    ids=["not-a-run", "no-checkpoint", "no-adapter", "not-a-finetune-checkpoint"],
)
def test_export_refuses_a_run_without_adapters_to_export_in_one_line(make, message: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    make(tmp_path / "run")
    assert cli.main(["export", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "run" / "adapter").exists()


def test_validate_of_a_qlora_recipe_prints_only_its_verdict(runs: tuple[Path, dict[str, Any]]) -> None:
    checked = runs[1]["validate"]
    assert checked.returncode == 0, checked.stderr
    assert (checked.stdout, checked.stderr) == ("ok  llama-tiny_qlora_cpu\n", "")


def test_only_the_known_import_lines_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_accel.models.import_noise import drop_import_noise

    drop_import_noise()
    drop_import_noise()  # idempotent
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
        logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
                                                         "value type.", "<enum 'KernelPreference'>")
        logging.getLogger("torchao").warning("Failed to load /data/my_weights.pt: truncated")  # a real one stays
        logging.getLogger("torch.utils._pytree").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load /data/my_weights.pt: truncated", "something else"]
