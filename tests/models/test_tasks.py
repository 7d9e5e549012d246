"""Tasks: short CPU fits, logged metrics against hand computations, optimizer/scheduler factories."""

import math
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import GPT, ClassifierTask, LanguageModelTask

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning"),
]

VOCAB = 32
# training_step called by hand, outside a Trainer, in the loss-reference tests below
NO_TRAINER_LOG = "ignore:You are trying to `self.log\\(\\)` but the `self.trainer` reference:UserWarning"


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def tiny_gpt() -> GPT:
    return GPT("tiny", vocab_size=VOCAB, n_layer=1, n_embd=32, n_head=2, block_size=16)


def lm_loader(n: int, batch_size: int) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (n, 17))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)  # y = x shifted


def class_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, 2, 2)
    y = x.flatten(1)[:, :3].argmax(1)  # a rule a linear layer can learn
    return x, y


def lm_loss(net: nn.Module, loader: DataLoader) -> tuple[float, int]:
    """Sum of token cross-entropies and the token count, in plain torch."""
    with torch.no_grad():
        pairs = [(F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum"), y.numel()) for x, y in loader]
    return sum(s.item() for s, _ in pairs), sum(n for _, n in pairs)


def test_language_model_fit_reduces_loss_and_logs() -> None:
    net = tiny_gpt()
    train = lm_loader(8, 8)  # one batch, seen every step
    before, count = lm_loss(net, train)
    task = LanguageModelTask(net, optimizer=partial(torch.optim.Adam, lr=1e-2))
    trainer = make_trainer()
    trainer.fit(task, train_dataloaders=train, val_dataloaders=lm_loader(4, 4))
    after, _ = lm_loss(net.eval(), train)
    assert trainer.global_step == 5
    assert after < 0.9 * before
    assert {"train/loss", "val/loss", "val/ppl"} <= set(trainer.callback_metrics)


def test_logged_perplexity_is_exp_of_token_mean_cross_entropy() -> None:
    task = LanguageModelTask(tiny_gpt())
    val = lm_loader(10, 4)  # batches of 4, 4, 2 sequences: the epoch mean must weight them
    total, count = lm_loss(task.net.eval(), val)
    (val_metrics,) = make_trainer().validate(task, dataloaders=val, verbose=False)
    (test_metrics,) = make_trainer().test(task, dataloaders=val, verbose=False)
    for metrics, stage in ((val_metrics, "val"), (test_metrics, "test")):
        assert metrics[f"{stage}/loss"] == pytest.approx(total / count, rel=1e-5)
        assert metrics[f"{stage}/ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)
        assert metrics[f"{stage}/ppl"] == pytest.approx(math.exp(metrics[f"{stage}/loss"]), rel=1e-4)


def test_classifier_fit_accepts_any_module_and_logs_accuracy() -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))  # a user's module: no pre/blocks/post
    x, y = class_data(32)
    train = DataLoader(TensorDataset(x, y), batch_size=32)
    before = F.cross_entropy(net(x), y).item()
    task = ClassifierTask(net, num_classes=3, optimizer=partial(torch.optim.Adam, lr=5e-2))
    trainer = make_trainer()
    trainer.fit(task, train_dataloaders=train)
    assert F.cross_entropy(net(x), y).item() < 0.9 * before
    assert {"train/loss", "train/acc"} <= set(trainer.callback_metrics)

    vx, vy = class_data(10)
    val = DataLoader(TensorDataset(vx, vy), batch_size=4)  # 4, 4, 2
    with torch.no_grad():
        logits = net(vx)
    (metrics,) = make_trainer().validate(task, dataloaders=val, verbose=False)
    assert metrics["val/acc"] == pytest.approx((logits.argmax(1) == vy).float().mean().item())
    assert metrics["val/loss"] == pytest.approx(F.cross_entropy(logits, vy).item(), rel=1e-5)
    (metrics,) = make_trainer().test(task, dataloaders=val, verbose=False)
    assert metrics["test/acc"] == pytest.approx((logits.argmax(1) == vy).float().mean().item())


def test_step_scheduler_is_called_every_optimizer_step() -> None:
    task = LanguageModelTask(
        tiny_gpt(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
        scheduler_interval="step",
    )
    trainer = make_trainer(max_steps=5)
    trainer.fit(task, train_dataloaders=lm_loader(4, 2))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (5 // 2))


def test_epoch_scheduler_is_called_every_epoch() -> None:
    x, y = class_data(8)
    task = ClassifierTask(
        nn.Sequential(nn.Flatten(), nn.Linear(12, 3)),
        num_classes=3,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        scheduler=partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda epoch: 0.5**epoch),
        scheduler_interval="epoch",
    )
    trainer = make_trainer(max_steps=-1, max_epochs=3)
    trainer.fit(task, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=4))  # 2 steps per epoch
    assert trainer.global_step == 6
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # per step would be 0.5**6


def test_default_optimizer_is_adamw_over_all_parameters() -> None:
    net = tiny_gpt()
    optimizer = LanguageModelTask(net).configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 3e-4
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in net.parameters()}


def test_hparams_are_yaml_plain_and_checkpoint_round_trips(tmp_path) -> None:
    task = LanguageModelTask(tiny_gpt(), optimizer=partial(torch.optim.SGD, lr=0.1))
    assert dict(task.hparams) == {"scheduler_interval": "step"}
    classifier = ClassifierTask(nn.Linear(4, 3), num_classes=3, scheduler_interval="epoch")
    assert yaml.safe_load(yaml.safe_dump(dict(classifier.hparams))) == {"num_classes": 3, "scheduler_interval": "epoch"}

    trainer = make_trainer(max_steps=1)
    trainer.fit(task, train_dataloaders=lm_loader(2, 2))
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    restored = LanguageModelTask.load_from_checkpoint(tmp_path / "lm.ckpt", net=tiny_gpt())
    for key, value in task.net.state_dict().items():
        assert torch.equal(restored.net.state_dict()[key], value), key


def test_bad_scheduler_interval_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"scheduler_interval must be 'step' or 'epoch', got 'batch'"):
        LanguageModelTask(tiny_gpt(), scheduler_interval="batch")


def test_classifier_needs_two_classes() -> None:
    with pytest.raises(ValueError, match=r"ClassifierTask needs num_classes >= 2, got 1"):
        ClassifierTask(nn.Linear(4, 1), num_classes=1)


def test_classifier_rejects_logits_of_the_wrong_width() -> None:
    task = ClassifierTask(nn.Linear(4, 5), num_classes=3)
    with pytest.raises(ValueError, match=r"needs the net to return logits \(2, 3\), got \(2, 5\)"):
        task.training_step((torch.randn(2, 4), torch.tensor([0, 1])), 0)


def test_language_model_rejects_non_sequence_logits() -> None:
    task = LanguageModelTask(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Linear(8 * 4, VOCAB)))
    x = torch.randint(0, VOCAB, (2, 4))
    with pytest.raises(ValueError, match=r"targets \(B, T\)=\(2, 4\), got \(2, 32\)"):
        task.training_step((x, x), 0)


def _manual_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of -log softmax(logits)[target], gathered by hand (no F.cross_entropy)."""
    log_probs = logits - logits.logsumexp(-1, keepdim=True)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


@pytest.mark.filterwarnings(NO_TRAINER_LOG)
def test_language_model_loss_on_a_transformers_llama_equals_its_own_and_a_hand_computed_one() -> None:
    pytest.importorskip("transformers", reason="needs the hf extra")
    from lightning_accel.models.hf import hf_causal_lm

    net = hf_causal_lm({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "use_cache": False},
                       dtype="float64")
    task = LanguageModelTask(net)
    tokens = torch.randint(0, VOCAB, (3, 13))
    x, y = tokens[:, :-1], tokens[:, 1:]  # what the text data modules yield
    loss = task.training_step((x, y), 0)
    with torch.no_grad():
        # transformers' own loss: labels = the input, shifted inside the model (causal: the
        # logits of the first 12 positions do not depend on the 13th token)
        own = net(tokens, labels=tokens).loss
        by_hand = _manual_token_nll(net(tokens).logits[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss.detach().float(), own)  # transformers upcasts logits to float32 for its loss
    torch.testing.assert_close(loss.detach(), by_hand, rtol=1e-12, atol=0)
    loss.backward()  # the loss is differentiable through the model's output object
    assert net.model.embed_tokens.weight.grad is not None


@pytest.mark.filterwarnings(NO_TRAINER_LOG)
def test_language_model_fit_on_litgpt_reduces_loss_and_matches_a_hand_computed_loss() -> None:
    pytest.importorskip("litgpt", reason="needs the hf extra")
    from lightning_accel.models.litgpt_model import litgpt_gpt

    net = litgpt_gpt("pythia-14m", {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB,
                                    "padded_vocab_size": VOCAB, "block_size": 16})
    train = lm_loader(8, 8)
    x, y = next(iter(train))
    with torch.no_grad():
        torch.testing.assert_close(LanguageModelTask(net).training_step((x, y), 0), _manual_token_nll(net(x), y))
    before, _ = lm_loss(net, train)
    make_trainer().fit(LanguageModelTask(net, optimizer=partial(torch.optim.Adam, lr=1e-2)), train_dataloaders=train)
    assert lm_loss(net.eval(), train)[0] < 0.9 * before


def test_language_model_rejects_outputs_without_logits() -> None:
    class Pair(nn.Module):
        def forward(self, x):
            return (x.float(), x.float())

    with pytest.raises(TypeError, match=r"or an output with a .logits tensor .*got tuple"):
        LanguageModelTask(Pair()).training_step((torch.zeros(2, 4, dtype=torch.long),) * 2, 0)
