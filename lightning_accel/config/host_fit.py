"""A network whose parameters alone exceed the machine's memory, refused before work: :func:`check_network_fits_host`.

Why: ``model.net.vocab_size=1000000000000`` (a typo's extra zeros) builds fine on the meta device, passes every other
check, and fails after set-up in the allocator's words (``DefaultCPUAllocator: can't allocate memory: you tried to
allocate 512000000000000 bytes``), naming no key. Preflight already holds the network on meta, so its parameter bytes
are known for free; where they exceed what the machine has (memory and swap, or the cgroup's limit where one is lower),
a run that keeps the parameters in host memory (on the CPU device, or under L2L offload's host masters) cannot start. The NVMe tier (``strategy.nvme_path``) streams
parameters from disk and plans its own budget (``offload/tier_plan.py``), so it is left to that plan.

The refusal names the key whose value sized the largest tensor (found in ``model``'s config by the value it holds) and
two fixes. No Lightning here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_accel.config.data_fit import _flat  # a config's settings as (dotted key, value): data_fit's, one copy
from lightning_accel.config.errors import UserError

__all__ = ["check_network_fits_host", "host_memory_bytes"]


def host_memory_bytes() -> tuple[int, str] | None:
    """The most memory this process could ever hold, and what says so: physical memory plus swap, or the cgroup's
    ``memory.max`` where it is lower; None where /proc cannot be read (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = (int(fields["MemTotal"].split()[0]) + int(fields.get("SwapTotal", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    what = "this machine's memory and swap"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and int(limit) < total:
            return int(limit), "this cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return total, what


def _sizing_key(cfg: DictConfig, shape: tuple[int, ...]) -> str | None:
    """The key under ``model`` (or ``data``, whose values models interpolate) holding the largest of ``shape``'s sizes."""
    for size in sorted(set(shape), reverse=True):
        for group in ("model", "data"):
            try:
                flat = dict(_flat(OmegaConf.to_container(cfg.get(group) or {}, resolve=True), group))
            except Exception:
                continue
            found = [k for k, v in flat.items() if isinstance(v, int) and not isinstance(v, bool) and v == size and size > 1]
            if found:
                return min(found, key=len)
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n < 1e12 else f"{n / 1e12:,.1f} TB"


def _held_on_host(cfg: DictConfig, strategy: Any) -> bool:
    """Whether the run keeps every parameter in host memory: on the CPU device, or under L2L offload (fp32 masters on
    the host). On a GPU another strategy may hold only a part on each device and never the whole on the host (a
    pipeline stage materialized from meta), so the whole network against host memory proves nothing there."""
    import torch

    accelerator = str((cfg.get("trainer") or {}).get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return on_cpu or "L2LOffload" in str(strategy.get("_target_", ""))


def check_network_fits_host(module: Any, cfg: DictConfig) -> None:
    """Refuse ``module`` (built on meta) when its parameters alone exceed :func:`host_memory_bytes` where the run keeps
    them all in host memory (the CPU device; L2L offload), unless the strategy streams them from disk (``nvme_path``)."""
    strategy = cfg.get("strategy") or {}
    if not isinstance(module, nn.Module) or strategy.get("nvme_path") is not None or not _held_on_host(cfg, strategy):
        return
    machine = host_memory_bytes()
    params = list(module.parameters())
    if machine is None or not params:
        return
    total = sum(p.numel() * p.element_size() for p in params)
    if total <= machine[0]:
        return
    name, largest = max(((n, p) for n, p in module.named_parameters()), key=lambda item: item[1].numel())
    shape = tuple(largest.shape)
    key = _sizing_key(cfg, shape)
    where = f"{key}={OmegaConf.select(cfg, key)}: " if key is not None else "model: "
    dims = " x ".join(str(s) for s in shape)
    raise UserError(f"{where}the network's parameters alone are {_gb(total)} (largest: {name}, {dims}), more than "
                    f"{machine[1]} ({_gb(machine[0])}); shrink {key or 'the model'}, or stream the weights from disk "
                    "with strategy=l2l_offload strategy.nvme_path=DIR")
