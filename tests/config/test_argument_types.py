"""Every scalar argument a shipped recipe hands a constructor (the data module, the model and the nodes inside it, the
strategy, callbacks), found from the constructors' own signatures (:mod:`lightning_accel.config.argument_types`), not
a hand list: each gets the bad values of its kind and is refused in one line naming the key and the value, before any
work; the example the line offers passes. Two bounds no annotation states, by class too: worker processes beyond what
the machine lets a user start, and a network whose parameters alone exceed the machine's memory."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from lightning_accel.config import argument_types
from lightning_accel.config import host_fit
from lightning_accel.config.argument_types import check_argument_types
from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import check_job
from lightning_accel.data import loaders
from tests.support.edited_configs import composed, job

# between them: a text data module, synthetic tokens, images, a GPT, a transformers Llama, a CNN, each strategy of ours
RECIPES = (("gpt-tiny_cpu", ()), ("gpt-tiny_l2l-nvme_cpu", ()), ("gpt-tiny_gpipe_cpu", ()), ("llama-tiny_cpu", ()),
           ("resnet-small_io-bound_cpu", ()), ("gpt-tiny_gpipe-2proc_cpu", ()), ("gpt-tiny_cpu", ("strategy=l2l_offload_ddp",)))
GROUPS = ("data", "model", "strategy", "callbacks")
BAD = {int: [0.5, "abc", True, math.nan], float: ["abc", True, math.nan], bool: [2, "abc", 0.5]}


def _scalar_keys(node: Any, where: str) -> list[tuple[str, type]]:
    """``(dotted key, kind)`` for every scalar of ``node`` (a composed config node) whose constructor's annotation is
    exactly int, float or bool; nodes with a structured schema (the callbacks' ModelCheckpoint...) are left to it: a
    value of the wrong type fails their composition (tests/config/test_schema.py)."""
    found: list[tuple[str, type]] = []
    if not OmegaConf.is_dict(node) or OmegaConf.get_type(node) is not dict:
        return found
    target = argument_types._target(node.get("_target_"))
    annotations = argument_types._annotations(target) if target is not None else {}
    for key in node.keys():
        if str(key).startswith("_"):
            continue
        value = node._get_node(key)
        if OmegaConf.is_dict(value):
            found += _scalar_keys(value, f"{where}.{key}")
        elif (kind := argument_types._scalar(annotations.get(key))[0]) is not None:
            found.append((f"{where}.{key}", kind))
    return found


def _cases() -> list[tuple[str, tuple[str, ...], str, type]]:
    seen: dict[str, tuple[str, tuple[str, ...], str, type]] = {}
    for recipe, groups in RECIPES:
        cfg = composed(recipe, groups)
        for group in GROUPS:
            for key, kind in _scalar_keys(cfg.get(group), group):
                seen.setdefault(f"{recipe}:{key}", (recipe, groups, key, kind))
    return sorted(seen.values(), key=lambda c: c[2])


CASES = _cases()
_PLAIN: dict[tuple[str, tuple[str, ...], str], dict] = {}


def _node(recipe: str, groups: tuple[str, ...], where: str) -> dict:
    """A copy of the node at ``where`` as plain data, resolved once per recipe (editing a copy of a plain dict is far
    cheaper than editing a composed config)."""
    group, *path = where.split(".")
    if (recipe, groups, group) not in _PLAIN:
        node = composed(recipe, groups)[group]
        try:
            _PLAIN[recipe, groups, group] = OmegaConf.to_container(node, resolve=True)
        except Exception:  # an interpolation only a run resolves (${hydra:runtime.output_dir}): the node as written
            _PLAIN[recipe, groups, group] = OmegaConf.to_container(node, resolve=False)
    found = _PLAIN[recipe, groups, group]
    for part in path:
        found = found[part]
    return copy.deepcopy(found)


def test_the_generated_keys_cover_each_group() -> None:
    keys = {key for _, _, key, _ in CASES}
    assert {"data.seed", "data.num_workers", "data.batch_size", "model.net.dropout", "strategy.prefetch_blocks",
            "strategy.chunks", "strategy.checkpoint_blocks"} <= keys, sorted(keys)
    assert any(k.startswith("callbacks.") for k in keys), sorted(keys)
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize(("recipe", "groups", "key", "kind"), CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_each_wrong_kind_is_one_line_naming_the_key_and_its_example_passes(recipe: str, groups: tuple[str, ...], key: str,
                                                                           kind: type) -> None:
    where, leaf = key.rsplit(".", 1)  # the node that holds the key: the constructor that takes it

    def node_with(value: Any) -> dict:
        node = _node(recipe, groups, where)
        node[leaf] = value
        return node

    for value in BAD[kind]:
        with pytest.raises(UserError) as raised:
            check_argument_types(where, node_with(value))
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"{key}={value}: ") and "; " in line, line
        example = re.search(rf"e\.g\. {re.escape(key)}=(\S+)$", line)
        if example is not None:  # the fix offered, applied as Hydra would read it, passes
            check_argument_types(where, node_with(yaml.safe_load(example.group(1))))
    check_argument_types(where, _node(recipe, groups, where))  # the recipe's own value passes


@pytest.mark.parametrize(("override", "key"), [("data.seed=abc", "data.seed"), ("model.net.dropout=nan", "model.net.dropout"),
                                               ("strategy.checkpoint_blocks=2", "strategy.checkpoint_blocks")])
def test_preflight_asks_it_of_every_job(override: str, key: str) -> None:
    """Wired where each node is built: ``run`` and ``validate`` refuse it before any work (one case per group)."""
    overrides = ["strategy=l2l_offload", override] if override.startswith("strategy.") else [override]
    with pytest.raises(UserError, match=rf"^{re.escape(key)}="):
        check_job(*job("gpt-tiny_cpu", overrides), launch=False)


def test_num_workers_beyond_what_the_machine_lets_a_user_start_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loaders, "_process_limit", lambda: (64, "ulimit -u"))
    with pytest.raises(UserError) as raised:
        check_job(*job("gpt-tiny_cpu", ["data.num_workers=65"]), launch=False)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("data.num_workers=65: ") and "(64, ulimit -u)" in line, line
    check_job(*job("gpt-tiny_cpu", ["data.num_workers=64"]), launch=False)  # at the limit: allowed
    for module in ("synthetic", "shapes"):  # every data module asks the same check (the Python API too)
        from importlib import import_module

        cls = {"synthetic": "SyntheticDataModule", "shapes": "ShapesDataModule"}[module]
        with pytest.raises(ValueError, match=r"^num_workers=65 is more worker processes"):
            getattr(import_module(f"lightning_accel.data.{module}"), cls)(num_workers=65)


def test_a_network_larger_than_the_machine_is_refused_naming_the_key_that_sized_it(monkeypatch: pytest.MonkeyPatch,
                                                                                   tmp_path: Path) -> None:
    # the tiny GPT's 128-wide table of 4,000,000 rows is 2 GB in float32: over a machine of 1 GB
    monkeypatch.setattr(host_fit, "host_memory_bytes", lambda: (10**9, "this machine's memory and swap"))
    overrides = ["model.net.vocab_size=4000000"]
    with pytest.raises(UserError) as raised:
        check_job(*job("gpt-tiny_cpu", overrides), launch=True)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model.net.vocab_size=4000000: the network's parameters alone are 2."), line
    assert "shrink model.net.vocab_size" in line and "strategy.nvme_path=DIR" in line, line
    check_job(*job("gpt-tiny_cpu", overrides), launch=False)  # validate checks a recipe for any machine
    check_job(*job("gpt-tiny_cpu", [*overrides, "strategy=l2l_offload", f"strategy.nvme_path={tmp_path}"]),
              launch=True)  # the tier streams it from disk and plans its own budget
    check_job(*job("gpt-tiny_cpu", []), launch=True)  # the recipe as shipped fits


def test_host_memory_is_read_from_this_machine() -> None:
    found = host_fit.host_memory_bytes()
    assert found is not None and found[0] > 2**30, found


def test_the_network_against_host_memory_only_where_the_run_keeps_it_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a strategy other than L2L may never hold the whole network on the host (a pipeline stage built from
    meta): not refused there; under L2L (fp32 masters on the host) it is, on any device."""
    monkeypatch.setattr(host_fit, "host_memory_bytes", lambda: (10**9, "this machine's memory and swap"))
    with torch.device("meta"):
        big = torch.nn.Embedding(4_000_000, 128)
    gpu = OmegaConf.create({"trainer": {"accelerator": "gpu"}, "strategy": {"_target_": "lightning.pytorch.strategies.DDPStrategy"}})
    host_fit.check_network_fits_host(big, gpu)
    l2l = OmegaConf.create({"trainer": {"accelerator": "gpu"}, "strategy": {"_target_": "lightning_accel.strategies.L2LOffloadStrategy"}})
    with pytest.raises(UserError, match=r"^model: the network's parameters alone are 2\.0 GB \(largest: weight, 4000000 x 128\)"):
        host_fit.check_network_fits_host(big, l2l)
