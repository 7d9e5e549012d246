"""How much host memory is free: Linux's ``MemAvailable`` (what can be allocated without swapping)."""

from __future__ import annotations


def available_host_bytes() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` of ``/proc/meminfo``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
