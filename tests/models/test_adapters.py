"""model.adapter: peft LoRA and QLoRA (NF4 base) applied by LanguageModelTask, and the checkpoints of a fine-tune.

Tiny transformers Llamas with random weights (nothing downloaded); every block Linear is a multiple of 64 x 256
elements, as torchao's to_nf4 needs. References are computed another way: the base's own logits, a base whose
weights are the NF4 ones dequantized by hand, an uninterrupted fit.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel.config.errors import UserError
from lightning_accel.models import LanguageModelTask

transformers = pytest.importorskip("transformers", reason="needs the hf extra")
peft = pytest.importorskip("peft", reason="needs the finetune extra")
pytest.importorskip("torchao", reason="needs the finetune extra")

from lightning_accel.models import finetune_checkpoint  # noqa: E402
from lightning_accel.models.adapters import LoRA, QLoRA  # noqa: E402
from lightning_accel.models.extras import MissingExtraError  # noqa: E402
from lightning_accel.models.finetune_checkpoint import FINETUNE_KEY, fingerprint  # noqa: E402
from lightning_accel.models.quantize import load_to_nf4  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata 0.11 on torch 2.13
]

VOCAB = 64
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
NF4 = type(load_to_nf4()(torch.zeros(64 * 256), 64, 256))
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama(seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32, **dims: int) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=32, use_cache=False,
                                      **(dims or SMALL))
    return transformers.LlamaForCausalLM(config).to(dtype)


def tokens(n: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 17), generator=torch.Generator().manual_seed(1))


def loader() -> StatefulDataLoader:
    t = tokens(32)  # a loader that resumes mid-epoch where it stopped, as the recipes' loaders do
    return StatefulDataLoader(TensorDataset(t[:, :-1], t[:, 1:]), batch_size=4)


def logits(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net(x).logits


def fit(task: LanguageModelTask, steps: int, ckpt_dir: Path | None = None, ckpt_path: str | None = None, every: int = 2) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=every, save_top_k=-1)] if ckpt_dir else []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(task, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return trainer


def adapters(task: LanguageModelTask) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in task.named_parameters() if p.requires_grad}


# --- the adapter group ---------------------------------------------------------------------------------------------


def test_lora_keys_reach_peft_and_only_the_adapters_train() -> None:
    base = llama()
    reference = copy.deepcopy(base)
    task = LanguageModelTask(base, adapter=LoRA(r=4, alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True))
    assert type(task.net).__name__ == "PeftModelForCausalLM"
    config = task.net.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora, set(config.target_modules)) == (4, 8, True, {"q_proj", "v_proj"})
    trainable = [n for n, p in task.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2 and all(re.fullmatch(r"net\.base_model\.model\.model\.layers\.\d\.self_attn\.[qv]_proj\."
                                                            r"lora_[AB]\.default\.weight", n) for n in trainable), trainable
    x = tokens(2)[:, :16]
    torch.testing.assert_close(logits(task.net, x), logits(reference, x), rtol=0, atol=0)  # LoRA's B starts at zero


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"rr": 4}, r"^model\.adapter\.rr: 'rr' is not a peft LoraConfig key \(did you mean 'r'\?\); use r, alpha, dropout"),
        ({"target_module": ["q_proj"]}, r"'target_module' is not a peft LoraConfig key \(did you mean 'target_modules'"),
        ({"lora_alpha": 32}, r"^model\.adapter\.lora_alpha is written model\.adapter\.alpha here; set model\.adapter\.alpha=32$"),
        ({"r": 0}, r"^model\.adapter: `r` should be a positive integer .*; fix that key of model/adapter=lora$"),
        ({"target_modules": ["q_projj"]}, r"^model\.adapter\.target_modules=\['q_projj'\]: Target modules \{'q_projj'\} not found "
                                          r"in the base model.*; name modules of LlamaForCausalLM, e.g. any of its Linear layers: down_proj"),
    ],
    ids=["typo", "close-match", "peft-long-name", "bad-value", "no-such-module"],
)
def test_a_bad_adapter_key_is_one_line(keys: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as refused:
        LanguageModelTask(llama(), adapter=LoRA(**keys))
    assert "\n" not in str(refused.value)


def test_an_unknown_key_from_the_command_line_is_one_line_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel import cli

    assert cli.main(["validate", "llama-tiny_lora_cpu", "+model.adapter.use_rslroa=true"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(r"'use_rslroa' is not a peft LoraConfig key \(did you mean 'use_rslora'", line), line


def test_the_option_is_chosen_like_any_group_and_keys_set_like_any_key() -> None:
    from lightning_accel.config.compose import compose_recipe

    assert compose_recipe("llama-tiny_cpu").model.adapter is None  # model/adapter=none, the default
    cfg = compose_recipe("llama-tiny_cpu", ["model/adapter=qlora", "model.adapter.r=16"])
    assert cfg.model.adapter._target_.endswith("adapters.QLoRA") and cfg.model.adapter.r == 16
    assert compose_recipe("llama-tiny_lora_cpu").model.adapter._target_.endswith("adapters.LoRA")


@pytest.mark.parametrize(("module", "build"), [("peft", "lora"), ("torchao", "qlora")])
def test_a_missing_library_names_the_extra(module: str, build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import peft / torchao now fails as when not installed
    if build == "lora":
        monkeypatch.delitem(sys.modules, "lightning_accel.models.adapters")
        with pytest.raises(MissingExtraError, match=r'model.adapter needs peft, which is not installed; it comes with the finetune extra: '
                                                    r'pip install "lightning-accel\[finetune\]"'):
            import lightning_accel.models.adapters  # noqa: F401
    else:
        with pytest.raises(MissingExtraError, match=r"model/adapter=qlora needs torchao, .* the finetune extra"):
            QLoRA()


# --- QLoRA ---------------------------------------------------------------------------------------------------------


def test_qlora_turns_the_block_linears_into_nf4_and_computes_with_them() -> None:
    base = llama()
    original = copy.deepcopy(base)
    task = LanguageModelTask(base, adapter=QLoRA(target_modules=["q_proj", "v_proj"]))
    model = task.net.get_base_model()
    quantized = {n.removesuffix(".weight").replace(".base_layer", ""): p for n, p in model.named_parameters() if isinstance(p.data, NF4)}
    assert sorted(quantized) == sorted(f"model.layers.{i}.{part}.{name}" for i in range(2) for name in BLOCK_LINEARS
                                       for part in (["self_attn"] if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else ["mlp"]))
    assert all(not p.requires_grad for p in quantized.values())
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):  # as loaded
        assert torch.equal(model.get_parameter(name), original.get_parameter(name)), name
    # the reference: the original model with each block Linear's weight replaced by its NF4 weight dequantized by hand
    reference = copy.deepcopy(original)
    for name, weight in quantized.items():
        reference.get_submodule(name).weight.data = weight.data.get_original_weight().to(torch.float32)
    x = tokens(2)[:, :16]
    torch.testing.assert_close(logits(task.net, x), logits(reference, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(task.net, x), logits(original, x), atol=1e-4)  # it really computes on 4 bits


def test_qlora_refuses_a_weight_to_nf4_cannot_take_with_the_fix() -> None:
    dims = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
    message = (r"^model\.adapter: model\.layers\.0\.self_attn\.q_proj\.weight \(64, 64\) has 4096 elements, not a multiple of "
               r"block_size x scaler_block_size = 64 x 256 = 16384 as torchao's to_nf4 needs; set model\.adapter\.scaler_block_size=64 "
               r"\(it must divide 4096 / 64 = 64\), or leave it unquantized by listing the Linears to quantize in model\.adapter\.quantize_modules$")
    with pytest.raises(UserError, match=message):
        LanguageModelTask(llama(**dims), adapter=QLoRA())
    with torch.device("meta"), pytest.raises(UserError, match=message):  # the pre-run check says it too
        LanguageModelTask(llama(**dims), adapter=QLoRA())
    task = LanguageModelTask(llama(**dims), adapter=QLoRA(scaler_block_size=64))  # the fix it gives
    assert isinstance(task.net.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.data, NF4)
    task = LanguageModelTask(llama(**dims), adapter=QLoRA(quantize_modules=["gate_proj", "up_proj", "down_proj"]))  # or the other
    layer = task.net.get_base_model().model.layers[0]
    assert isinstance(layer.mlp.up_proj.weight.data, NF4) and not isinstance(layer.self_attn.q_proj.base_layer.weight.data, NF4)


def test_qlora_without_blocks_asks_for_the_linears_by_name() -> None:
    with pytest.raises(UserError, match=r"^model/adapter=qlora quantizes the Linears of LlamaForCausalLM's repeated blocks, and it has "
                                        r"none \(no blocks found .*\); name the Linears to quantize: model\.adapter\.quantize_modules="):
        LanguageModelTask(llama(layers=1), adapter=QLoRA())
    task = LanguageModelTask(llama(layers=1), adapter=QLoRA(quantize_modules=["q_proj", "v_proj"]))
    assert isinstance(task.net.get_base_model().model.layers[0].self_attn.v_proj.base_layer.weight.data, NF4)


def test_on_the_meta_device_qlora_checks_and_quantizes_nothing() -> None:
    with torch.device("meta"):
        task = LanguageModelTask(llama(), adapter=QLoRA())
    weights = [p for n, p in task.named_parameters() if "base_layer" in n]
    assert weights and all(p.is_meta and type(p.data) is torch.Tensor for p in weights)


def test_the_finetune_recipes_build_on_meta_in_seconds_at_their_published_size() -> None:
    from lightning_accel.config.compose import compose_recipe
    from lightning_accel.runner import build_model

    for recipe, base, trained in (("llama-3.1-70b_qlora-l2l_1gpu", 70_553_706_496, 207_093_760),
                                  ("qwen2.5-7b_lora-l2l_1gpu", 7_615_616_512, 40_370_176)):
        started = time.perf_counter()
        with torch.device("meta"):
            task = build_model(compose_recipe(recipe))
        assert time.perf_counter() - started < 30, recipe
        assert sum(p.numel() for p in task.parameters() if not p.requires_grad) == base, recipe
        assert sum(p.numel() for p in task.parameters() if p.requires_grad) == trained, recipe  # the comments' arithmetic


# --- checkpoints of a fine-tune ------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [LoRA, QLoRA])
def test_the_checkpoint_holds_the_trainable_state_and_names_the_base(adapter: type, tmp_path: Path) -> None:
    base = llama()
    config = base.config.to_dict()
    task = LanguageModelTask(base, adapter=adapter(target_modules=["q_proj", "v_proj"]))
    fit(task, 2, tmp_path)
    checkpoint = torch.load(tmp_path / "step2.ckpt", weights_only=False)
    assert sorted(checkpoint["state_dict"]) == sorted(adapters(task))
    for key in ("optimizer_states", "loops", "lr_schedulers", "global_step"):
        assert key in checkpoint, key
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(adapters(task))
    record = checkpoint[FINETUNE_KEY]
    frozen = {n for n, p in task.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert set(record["keys"]) == frozen and record["pretrained_path"] is None and record["config"] == config
    assert record["sha256"] == fingerprint(task) and record["adapter"]["option"] == adapter.name
    assert record["adapter"]["target_modules"] == ["q_proj", "v_proj"]


def test_buffers_stay_in_the_checkpoint(tmp_path: Path) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)
            self.register_buffer("scale", torch.full((16,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.proj(self.embed(x)) * self.scale)

    task = LanguageModelTask(Scaled(), adapter=LoRA(target_modules=["proj"]))
    fit(task, 2, tmp_path)
    state = torch.load(tmp_path / "step2.ckpt", weights_only=False)["state_dict"]
    assert sorted(state) == sorted([*adapters(task), "net.base_model.model.scale"])


def test_the_base_is_hashed_once_per_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = finetune_checkpoint.fingerprint
    monkeypatch.setattr(finetune_checkpoint, "fingerprint", lambda module: calls.append(1) or real(module))
    task = LanguageModelTask(llama(), adapter=LoRA())
    fit(task, 6, tmp_path)
    assert len(list(tmp_path.glob("*.ckpt"))) == 3 and len(calls) == 1
    fit(task, 8, tmp_path, ckpt_path=str(tmp_path / "step6.ckpt"))  # another fit: a resume checks, then saves with it
    assert len(calls) == 2


@pytest.mark.parametrize("adapter", [LoRA, QLoRA])
def test_a_fit_resumed_from_a_checkpoint_ends_where_an_uninterrupted_one_does(adapter: type, tmp_path: Path) -> None:
    reference = LanguageModelTask(llama(), adapter=adapter())
    fit(reference, 6)
    first = LanguageModelTask(llama(), adapter=adapter())
    fit(first, 3, tmp_path, every=3)
    resumed = LanguageModelTask(llama(), adapter=adapter())
    frozen_before = {n: p.detach().clone() for n, p in resumed.named_parameters() if not p.requires_grad and type(p.data) is torch.Tensor}
    fit(resumed, 6, ckpt_path=str(tmp_path / "step3.ckpt"))  # Lightning's strict loading: the base's entries put back
    want, got = adapters(reference), adapters(resumed)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], adapters(first)[k]) for k in want)  # it trained past the checkpoint
    assert all(torch.equal(p, resumed.get_parameter(n)) for n, p in frozen_before.items())


def test_a_checkpoint_of_another_base_is_refused_naming_both(tmp_path: Path) -> None:
    from lightning_accel.models.hf import hf_causal_lm

    for seed, name in ((0, "a"), (1, "b")):
        llama(seed).save_pretrained(tmp_path / name)
    task = LanguageModelTask(hf_causal_lm(pretrained_path=str(tmp_path / "a")), adapter=LoRA())
    fit(task, 2, tmp_path / "ckpt")
    other = LanguageModelTask(hf_causal_lm(pretrained_path=str(tmp_path / "b")), adapter=LoRA())
    a, b = re.escape(str(tmp_path / "a")), re.escape(str(tmp_path / "b"))
    with pytest.raises(UserError, match=rf"^the checkpoint's adapters were trained on another base: sha256 [0-9a-f]{{16}} "
                                        rf"\(pretrained_path={a}\) there, [0-9a-f]{{16}} \(pretrained_path={b}\) here; "
                                        rf"resume with the base it names: model\.net\.pretrained_path={a}$"):
        fit(other, 4, ckpt_path=str(tmp_path / "ckpt" / "step2.ckpt"))
    same = LanguageModelTask(hf_causal_lm(pretrained_path=str(tmp_path / "a")), adapter=LoRA())
    fit(same, 4, ckpt_path=str(tmp_path / "ckpt" / "step2.ckpt"))  # the same base loads


def test_a_task_without_the_adapter_refuses_a_finetune_checkpoint(tmp_path: Path) -> None:
    fit(LanguageModelTask(llama(), adapter=QLoRA()), 2, tmp_path)
    with pytest.raises(UserError, match=r"^the checkpoint holds a fine-tune's adapters, not a whole model; resume with its adapter: "
                                        r"model/adapter=qlora$"):
        fit(LanguageModelTask(llama()), 4, ckpt_path=str(tmp_path / "step2.ckpt"))


def test_the_pre_run_checkpoint_check_takes_the_base_keys_as_present(tmp_path: Path) -> None:
    from lightning_accel.config.preflight import check_checkpoint

    fit(LanguageModelTask(llama(), adapter=LoRA()), 2, tmp_path)
    with torch.device("meta"):
        check_checkpoint(str(tmp_path / "step2.ckpt"), LanguageModelTask(llama(), adapter=LoRA()))
        with pytest.raises(UserError, match=r"does not fit this model: .*; it is a fine-tune's \(model/adapter=lora\): resume with that "
                                            r"model/adapter and its keys$"):
            check_checkpoint(str(tmp_path / "step2.ckpt"), LanguageModelTask(llama()))
        with pytest.raises(UserError, match=r"does not fit this model: .*lora_A.* is \(8, 128\) there, \(16, 128\) here"):
            check_checkpoint(str(tmp_path / "step2.ckpt"), LanguageModelTask(llama(), adapter=LoRA(r=16)))


def test_the_hash_reads_every_stored_byte() -> None:
    task = LanguageModelTask(llama(dtype=torch.bfloat16), adapter=QLoRA())
    digest = fingerprint(task)
    assert digest == fingerprint(LanguageModelTask(llama(dtype=torch.bfloat16), adapter=QLoRA()))  # the same base again
    codes = task.net.get_base_model().model.layers[1].mlp.down_proj.weight.data.quantized_data
    codes[-1] ^= 1  # one NF4 code of one weight
    assert fingerprint(task) != digest
    codes[-1] ^= 1
    norm = task.net.get_base_model().model.norm.weight  # a bf16 weight, one ulp
    norm.data.view(torch.int16)[0] += 1
    assert fingerprint(task) != digest
    with torch.device("meta"):
        assert fingerprint(LanguageModelTask(llama(), adapter=LoRA())) is None
