"""The recipes for real architectures: their configs are the published ones, GPU ones refuse
the CPU, and shrunk copies train end to end through `lightning-accel run`."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.config.validate import check_launchable

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

# (recipe, model class, parameter count as published: Llama 3.2 1B "1.23B", Qwen2.5-7B "7.61B")
REAL = [
    ("llama-3.2-1b_l2l-bf16_1gpu", "LlamaForCausalLM", 1_235_814_400),
    ("qwen2.5-7b_l2l-bf16_1gpu", "Qwen2ForCausalLM", 7_615_616_512),
    ("llama-3.1-8b_full-nvme_1gpu", "LlamaForCausalLM", 8_030_261_248),
]


def _meta_net(recipe: str, overrides: list[str] | None = None) -> torch.nn.Module:
    cfg = compose_recipe(recipe, overrides or [])
    with torch.device("meta"):
        return instantiate(cfg.model.net)  # as the runner does: the builder gets OmegaConf containers


@pytest.mark.parametrize(("recipe", "cls", "count"), REAL, ids=[r for r, _, _ in REAL])
def test_real_architecture_has_the_published_size(recipe: str, cls: str, count: int) -> None:
    net = _meta_net(recipe)
    assert type(net).__name__ == cls
    assert sum(p.numel() for p in net.parameters()) == count
    assert net.config.use_cache is False


def test_llama_3_2_1b_config_values() -> None:
    c = _meta_net("llama-3.2-1b_l2l-bf16_1gpu").config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 32, 8)
    assert (c.intermediate_size, c.vocab_size, c.head_dim, c.tie_word_embeddings) == (8192, 128256, 64, True)
    assert c.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_qwen2_5_7b_config_values() -> None:
    c = _meta_net("qwen2.5-7b_l2l-bf16_1gpu").config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (3584, 28, 28, 4)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (18944, 152064, False)
    assert c.rope_parameters["rope_theta"] == 1_000_000.0


def test_seven_b_recipe_streams_the_resident_unit() -> None:
    # 1.09B embedding + head parameters kept on the device in fp32 with AdamW state would be
    # 17.4 GB of the 24 GB: the recipe must stream them (see its memory arithmetic)
    cfg = compose_recipe("qwen2.5-7b_l2l-bf16_1gpu")
    assert cfg.strategy.offload_resident is True and cfg.plugins[0].precision == "bf16-mixed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("recipe", [r for r, _, _ in REAL])
def test_gpu_recipes_refuse_the_cpu(recipe: str) -> None:
    with pytest.raises(UserError, match=rf"recipe '{re.escape(recipe)}' needs 1 CUDA GPU\(s\).*override accelerator=cpu"):
        check_launchable(compose_recipe(recipe), recipe)


def test_ls_shows_the_architectures(ls_output: tuple[int, str]) -> None:
    status, printed = ls_output
    assert status == 0
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in printed.splitlines()[1:]}
    assert rows["llama-3.2-1b_l2l-bf16_1gpu"][1:3] == ["hf_causal_lm:llama (1.2B)", "gpux1"]
    assert rows["qwen2.5-7b_l2l-bf16_1gpu"][1:3] == ["hf_causal_lm:qwen2 (7.6B)", "gpux1"]
    assert rows["llama-tiny_gpipe-2proc_cpu"][1:3] == ["hf_causal_lm:llama (201.3K)", "cpux2"]


def test_a_recipe_loads_a_local_directory_instead_of_its_config(tmp_path: Path) -> None:
    """pretrained_path alone: the directory's config (a Qwen2 here) replaces the recipe's Llama, the line says so, and
    the model holds the saved weights. Before: "hf_causal_lm got both pretrained_path=... and a config"."""
    from lightning_accel.models.hf import hf_causal_lm

    saved = hf_causal_lm({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256})
    saved.save_pretrained(tmp_path / "mine")
    notes: list[str] = []
    cfg = compose_recipe("llama-tiny_cpu", [f"model.net.pretrained_path={tmp_path / 'mine'}"], notes=notes)
    assert cfg.model.net.config is None
    assert notes == [f"model.net.pretrained_path='{tmp_path / 'mine'}': its config.json (qwen2: 2 layers, hidden_size 32, "
                     "vocab_size 256) replaces the recipe's model.net.config"]
    task = instantiate(cfg.model)
    assert type(task.net).__name__ == "Qwen2ForCausalLM"
    torch.testing.assert_close(task.net.state_dict(), saved.state_dict(), rtol=0, atol=0)
    # the old spelling still composes, and says nothing: there is no recipe config left to replace
    notes.clear()
    assert compose_recipe("llama-tiny_cpu", ["model.net.config=null", f"model.net.pretrained_path={tmp_path / 'mine'}"],
                          notes=notes).model.net.config is None and notes == []


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["model.net.config.hidden_size=64"], r"model.net.config.hidden_size=64 contradicts model.net.pretrained_path='.*/mine', "
                                              r"whose config.json has hidden_size=32; drop model.net.config.hidden_size"),
        (["model.net.config={model_type: qwen2, num_hidden_layers: 4}"], r"model.net.config.model_type='qwen2' contradicts .* "
                                                                         r"model_type='llama'"),
        (["+model.net.config.sliding_window=8"], r"model.net.config.sliding_window=8 is not a key of the llama config.json in "
                                                 r"model.net.pretrained_path='.*/mine'; drop model.net.config.sliding_window"),
    ],
    ids=["contradicts", "a whole config", "not in config.json"],
)
def test_a_config_the_user_sets_against_the_directory_is_one_line_before_any_run(
        tmp_path: Path, given: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel import cli

    _save_tiny_llama(tmp_path / "mine")
    capsys.readouterr()
    assert cli.main(["run", "llama-tiny_lora_cpu", f"model.net.pretrained_path={tmp_path / 'mine'}", *given]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "outputs").exists()


def test_what_the_user_sets_in_agreement_with_the_directory_passes(tmp_path: Path) -> None:
    """The recipe's own keys (its random base: 4 layers of 128) are not compared; the user's, equal to config.json's, pass."""
    _save_tiny_llama(tmp_path / "mine")
    agreeing = ["model.net.config.hidden_size=32", "model.net.config={num_hidden_layers: 2, vocab_size: 256}"]
    cfg = compose_recipe("llama-tiny_lora_cpu", [f"model.net.pretrained_path={tmp_path / 'mine'}", *agreeing])
    assert cfg.model.net.config is None
    with pytest.raises(UserError, match=r"hidden_size=33 contradicts"):
        compose_recipe("llama-tiny_lora_cpu", [f"model.net.pretrained_path={tmp_path / 'mine'}", "model.net.config.hidden_size=33"])


def _save_tiny_llama(path: Path) -> torch.nn.Module:
    """A Llama for llama-tiny_cpu's data (byte vocabulary), written by save_pretrained."""
    from lightning_accel.models.hf import hf_causal_lm

    torch.manual_seed(0)
    saved = hf_causal_lm({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                          "tie_word_embeddings": True, "use_cache": False})
    saved.save_pretrained(path)
    return saved


@pytest.mark.parametrize("launch", [False, True], ids=["validate", "run"])
def test_a_save_pretrained_directory_passes_preflight(tmp_path: Path, launch: bool) -> None:
    from lightning_accel.config.preflight import preflight

    _save_tiny_llama(tmp_path / "mine")
    cfg = preflight("llama-tiny_cpu", [f"model.net.pretrained_path={tmp_path / 'mine'}"], launch=launch)
    assert cfg.model.net.pretrained_path == str(tmp_path / "mine") and cfg.model.net.config is None
    assert not (tmp_path / "outputs").exists()  # preflight makes no run directory


def _truncate(path: Path) -> None:
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:-64])


def _drop_a_layer(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize(
    ("breaks", "message"),
    [
        (lambda p: None, r"pretrained_path='.*/gone' does not exist; point it at a directory written by save_pretrained"),
        (lambda p: (p / "config.json").write_text("{"), r"pretrained_path='.*/mine': config.json is not valid JSON"),
        (lambda p: (p / "model.safetensors").unlink(), r"pretrained_path='.*/mine' has no weights file \(model.safetensors, "),
        (_truncate, r"pretrained_path='.*/mine': model.safetensors cannot be read, truncated or corrupt"),
        (_drop_a_layer, r"pretrained_path='.*/mine': the weights have no model.layers.1.self_attn.q_proj.weight \(9 of "),
    ],
    ids=["missing", "bad config.json", "no weights", "truncated", "missing tensors"],
)
def test_a_broken_directory_is_one_line_before_any_run(tmp_path: Path, command: str, breaks, message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel import cli

    _save_tiny_llama(tmp_path / "mine")
    breaks(tmp_path / "mine")
    path = tmp_path / ("gone" if "does not exist" in message else "mine")
    capsys.readouterr()  # save_pretrained's progress bar
    assert cli.main([command, "llama-tiny_cpu", f"model.net.pretrained_path={path}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "outputs").exists()  # refused in preflight, before Hydra makes a run directory


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+model.net.config.hidden_sizee=3", r"'hidden_sizee' is not a LlamaConfig key \(did you mean 'hidden_size'"),
        ("model.net.config.model_type=lama", r"model_type='lama' has no causal-LM model .*did you mean 'llama'"),
    ],
)
def test_a_config_typo_is_one_line_before_any_run(override: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel import cli

    assert cli.main(["validate", "llama-tiny_cpu", override]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line


def test_litgpt_option_composes_and_builds(tmp_path: Path) -> None:
    pytest.importorskip("litgpt", reason="needs the hf extra")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\ndefaults:\n  - train\n  - override /model: litgpt\n  - _self_\n")
    net = _meta_net(str(recipe), ["model.net.name=Llama-3.2-1B"])
    assert net.config.name == "Llama-3.2-1B" and net.config.padded_vocab_size == 256  # the byte corpus' vocabulary
    assert net.max_seq_length == 128  # data.block_size


# --- end to end, in a subprocess like a user -----------------------------------------------

# the real recipe, shrunk to seconds on the CPU: same strategy, precision (bf16 autocast on the
# CPU), callbacks and model class
SHRINK_TO_CPU = [
    "accelerator=cpu", "data.num_workers=0", "data.pin_memory=false",
    "data.block_size=32", "data.batch_size=4", "data.max_bytes=300000",
    "model.net.config.hidden_size=64", "model.net.config.intermediate_size=128", "model.net.config.num_hidden_layers=2",
    "model.net.config.num_attention_heads=4", "model.net.config.num_key_value_heads=2", "model.net.config.vocab_size=256",
    "model.net.config.bos_token_id=null", "model.net.config.eos_token_id=null",  # ids past the shrunk vocabulary
    "model.optimizer.lr=3e-3",  # the real models' rates move a 12-step run too little to see
    "trainer.max_steps=12", "trainer.accumulate_grad_batches=1", "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
]
E2E = [
    ("llama-tiny_cpu", ["data.block_size=32", "data.max_bytes=300000", "trainer.max_steps=12", "trainer.val_check_interval=6",
                        "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]),
    ("llama-3.2-1b_l2l-bf16_1gpu", [*SHRINK_TO_CPU, "model.net.config.head_dim=16"]),
    ("qwen2.5-7b_l2l-bf16_1gpu", SHRINK_TO_CPU),
    # the NVMe tier: without the 32 GB budget every block's state, masters and weights go to disk (outputs/nvme)
    ("llama-3.1-8b_full-nvme_1gpu", [*SHRINK_TO_CPU, "model.net.config.head_dim=16", "strategy.host_budget=null"]),
]


PIPELINE = "llama-tiny_gpipe-2proc_cpu"


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory, make_cli_env: Any, cli_processes: Any) -> dict[str, tuple[Path, Any]]:
    """Every run this file checks, side by side (one after another they took two minutes, a core idle while
    each imported Lightning): name -> (outputs directory, completed process); the saved model under
    ``mine``, with the model saved there."""
    root = tmp_path_factory.mktemp("hf-e2e")
    jobs = {recipe: cli_processes.job(["run", recipe, *overrides], make_cli_env(root / recipe)) for recipe, overrides in E2E}
    jobs[PIPELINE] = cli_processes.job(
        ["run", PIPELINE, "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "data.max_bytes=300000", "trainer.enable_progress_bar=false"],
        make_cli_env(root / PIPELINE), processes=2)
    saved = _save_tiny_llama(root / "mine")
    jobs["pretrained"] = cli_processes.job(
        ["run", "llama-tiny_cpu", f"model.net.pretrained_path={root / 'mine'}", "trainer.max_steps=2",
         "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "data.block_size=32",
         "data.max_bytes=100000", "trainer.enable_progress_bar=false"], make_cli_env(root / "pretrained"))
    done = cli_processes.side_by_side(jobs)
    return {name: (root / name, done[name]) for name in jobs} | {"mine": (root / "mine", saved)}


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "overrides"), E2E, ids=[r for r, _ in E2E])
def test_recipe_trains_through_the_cli(recipe: str, overrides: list[str], e2e: dict[str, tuple[Path, Any]]) -> None:
    outputs, proc = e2e[recipe]
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_json,) = (outputs / recipe).glob("*/run.json")
    status = json.loads(run_json.read_text())
    assert status["status"] == "completed" and status["global_step"] == 12
    with open(status["metrics_csv"]) as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # from ln(256) = 5.5 down
    # the checkpoint keeps transformers' parameter names, so it loads into the plain model
    state = torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert "net.model.layers.1.self_attn.q_proj.weight" in state and "net.lm_head.weight" in state


@pytest.mark.slow
def test_llama_pipeline_recipe_trains_in_two_processes(e2e: dict[str, tuple[Path, Any]]) -> None:
    outputs, proc = e2e[PIPELINE]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr  # two ranks, one stage each
    (run_json,) = (outputs / PIPELINE).glob("*/run.json")
    status = json.loads(run_json.read_text())
    assert status["status"] == "completed" and status["global_step"] == 8
    with open(status["metrics_csv"]) as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < losses[0] - 0.4, losses
    # the gathered checkpoint loads, strictly, into the plain transformers model the recipe describes
    from lightning_accel.models.hf import hf_causal_lm

    cfg = compose_recipe(PIPELINE)
    net = hf_causal_lm(cfg.model.net.config)
    state = torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}, strict=True)


@pytest.mark.slow
def test_a_run_trains_from_a_save_pretrained_directory(e2e: dict[str, tuple[Path, Any]]) -> None:
    outputs, proc = e2e["pretrained"]
    saved = e2e["mine"][1]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval mode" not in proc.stdout + proc.stderr  # from_pretrained's eval mode is undone: dropout is on in training
    # pretrained_path alone: the directory's config replaces the recipe's, said once, and the run composed it that way
    assert proc.stdout.count("its config.json (llama: 2 layers, hidden_size 32, vocab_size 256) replaces the recipe's "
                             "model.net.config") == 1, proc.stdout[-2000:]
    (run_json,) = (outputs / "llama-tiny_cpu").glob("*/run.json")
    assert "model.net.config=null" in (run_json.parent / ".hydra" / "overrides.yaml").read_text()
    status = json.loads(run_json.read_text())
    assert status["status"] == "completed" and status["global_step"] == 2
    # two AdamW steps from the saved weights: every tensor moved, none by more than the two steps'
    # learning rates (Adam moves a weight by about lr a step; max_lr 2e-3), where a fresh random
    # init would be off by several times the init's 0.02 std
    state = torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    moved = {k: (state[f"net.{k}"] - v).abs().max().item() for k, v in saved.state_dict().items()}
    assert min(moved.values()) > 0 and max(moved.values()) < 2 * 2e-3, moved
