"""The estimate as people and scripts read it: a table per rank kind, a verdict, and JSON.

The verdict compares each rank's device peak with the device size (``--device-memory``, or
the size the recipe states) and the host bytes of every rank of one machine together with
the host size (``--host-memory``, or this machine's available memory). With the NVMe tier
(``host_budget`` / ``nvme_path``) the tables gain a disk column and a line says what lives in each
tier and what crosses the disk per step, with the strategy's own plan line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.estimate.components import RankEstimate
from lightning_accel.offload.tier_plan import TierPlan
from lightning_accel.table import format_table

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# Memory of one accelerator a recipe's purpose or --device-memory may name (nominal; one GPU, one TPU chip). An A100
# comes with 40 or 80 GB and is named with its size ("A100 80GB"), which the size itself gives.
DEVICES = {
    "H200": 141 * 10**9, "H100": 80 * 2**30, "L40S": 48 * 2**30, "L4": 24 * 2**30, "A10G": 24 * 2**30, "A10": 24 * 2**30,
    "RTX 4090": 24 * 2**30, "RTX 3090": 24 * 2**30, "TPU v5p": 95 * 2**30, "TPU v5e": 16 * 2**30, "TPU v4": 32 * 2**30,
}


def _squash(text: str) -> str:
    return re.sub(r"[\s_-]", "", text).upper()


def named_device(text: str) -> tuple[str, int] | None:
    """``(name, bytes)`` of the first accelerator of :data:`DEVICES` that ``text`` names (``one TPU v4 chip``), else None."""
    for name in DEVICES:
        pattern = r"(?<![A-Za-z0-9])" + r"[\s_-]*".join(map(re.escape, _squash(name))) + r"(?![0-9])"
        if re.search(pattern, text, flags=re.IGNORECASE):
            return name, DEVICES[name]
    return None


def device_size(text: str) -> int:
    """``--device-memory``: a size (``24GB``, ``80GiB``), an accelerator of :data:`DEVICES` (``H100``, ``L4``, ``TPU v4``),
    or one named with its size (``A100-40GB``)."""
    try:
        return parse_size(text)
    except ValueError:
        pass
    sized = re.search(r"(\d+)\s*GB\b", text, flags=re.IGNORECASE)
    if sized:
        return int(sized.group(1)) * 10**9
    named = next((n for n in DEVICES if _squash(n) == _squash(text)), None)
    if named is None:
        raise ValueError(
            f"device {text!r} is not a size or an accelerator known here; write e.g. 24GB, 80GiB, A100-40GB or one of "
            + ", ".join(DEVICES)
        )
    return DEVICES[named]


def parse_size(text: str) -> int:
    """``"24GB"`` -> 24e9 bytes; ``"80GiB"``, ``"1.5TB"``, ``"512MB"``, plain bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not a number of bytes with a unit; write e.g. 24GB, 80GiB or 1.5TB")
    return int(float(match.group(1)) * _UNITS[unit])


def gb(nbytes: int) -> str:
    """Bytes in GB (10^9) with 2 decimals; under 0.1 GB in MB, under 0.1 MB in kB."""
    if nbytes == 0:
        return "0"
    if nbytes >= 1e8:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


@dataclass
class Estimate:
    """Every rank kind's bytes, the sizes they are judged against and the verdict."""

    recipe: str
    strategy: str
    ranks: list[RankEstimate]
    device_memory: int | None
    host_memory: int | None
    on_cpu: bool
    notes: list[str] = field(default_factory=list)
    device_memory_from: str | None = None  # where the device size came from, said in the verdict
    tier: TierPlan | None = None  # the NVMe tier's plan (l2l_offload with host_budget / nvme_path)

    @property
    def host_total(self) -> int:
        """Host bytes of every rank together (the ranks of one machine share its memory)."""
        return sum(r.host_bytes * r.count for r in self.ranks)

    @property
    def device_peak(self) -> int:
        return max((r.device_peak_bytes for r in self.ranks), default=0)

    @property
    def device_fits(self) -> bool | None:
        if self.on_cpu:
            return True
        return None if self.device_memory is None else self.device_peak <= self.device_memory

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_memory is None else self.host_total <= self.host_memory

    @property
    def fits(self) -> bool:
        """Every size that is known holds what it must."""
        return self.device_fits is not False and self.host_fits is not False

    def as_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "strategy": self.strategy,
            "ranks": [
                {"kind": r.kind, "count": r.count, "device_peak_bytes": r.device_peak_bytes, "host_bytes": r.host_bytes,
                 "components": {"device": dict(r.device), "host": dict(r.host),
                                **({"disk": dict(r.disk)} if self.tier is not None else {})},
                 **({"disk_bytes": r.disk_bytes} if self.tier is not None else {})}
                for r in self.ranks
            ],
            **({"tier": self._tier_json()} if self.tier is not None else {}),
            "device_memory_bytes": self.device_memory,
            "device_memory_from": self.device_memory_from,
            "host_memory_bytes": self.host_memory,
            "host_total_bytes": self.host_total,
            "fits": self.fits,
            "notes": list(self.notes),
        }

    def _tier_json(self) -> dict[str, Any]:
        assert self.tier is not None
        return {"plan": f"NVMe tier: {self.tier.describe()}", "budget_bytes": self.tier.budget,
                "offload_host_bytes": self.tier.host_bytes, "disk_bytes": self.tier.disk_bytes,
                "read_bytes_per_step": self.tier.step_read_bytes, "write_bytes_per_step": self.tier.step_write_bytes}

    def format(self) -> str:
        lines = []
        disk = self.tier is not None
        for r in self.ranks:
            names = list(dict.fromkeys([*r.device, *r.host, *r.disk]))
            rows = [(n, gb(r.device[n]) if n in r.device else "", gb(r.host[n]) if n in r.host else "",
                     *([gb(r.disk[n]) if n in r.disk else ""] if disk else [])) for n in names]
            rows.append(("total", gb(r.device_peak_bytes) if not self.on_cpu else "", gb(r.host_bytes),
                         *([gb(r.disk_bytes)] if disk else [])))
            where = "host (the CPU is the device)" if self.on_cpu else "host"
            header = ("component", "device peak", where, *(["disk (NVMe tier)"] if disk else []))
            lines += [f"{r.kind} (x{r.count}):", format_table(header, rows), ""]
        if self.tier is not None:
            lines.append(self.tiers())
        lines.append(self.verdict())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def tiers(self) -> str:
        """What lives in each tier and what crosses the disk per step; the strategy's own plan line."""
        assert self.tier is not None
        device = "the CPU (its bytes are host bytes)" if self.on_cpu else f"{gb(self.device_peak)} peak"
        disk = sum(r.disk_bytes * r.count for r in self.ranks)
        return (f"tiers: device {device}, host {gb(self.host_total)}, disk {gb(disk)}; per optimizer step the disk "
                f"reads {gb(self.tier.step_read_bytes)} and writes {gb(self.tier.step_write_bytes)}; "
                f"the strategy's plan: NVMe tier: {self.tier.describe()}")

    def verdict(self) -> str:
        if self.on_cpu:
            device = "device: the CPU (every byte is host memory)"
        elif self.device_memory is None:
            device = f"device: peak {gb(self.device_peak)} per rank, no device size known (pass --device-memory 24GB)"
        else:
            source = f" ({self.device_memory_from})" if self.device_memory_from else ""
            device = (f"device: peak {gb(self.device_peak)} per rank of {gb(self.device_memory)}{source}: "
                      + ("fits" if self.device_fits else "DOES NOT FIT"))
        if self.host_memory is None:
            host = f"host: {gb(self.host_total)} for all ranks, no host size known (pass --host-memory 256GB)"
        else:
            host = f"host: {gb(self.host_total)} for all ranks of {gb(self.host_memory)}: " + ("fits" if self.host_fits else "DOES NOT FIT")
        return f"{'fits' if self.fits else 'does not fit'}: {device}; {host}"
