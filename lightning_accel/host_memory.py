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


def _status_bytes(key: str) -> int | None:
    """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRSS:
    """How much host memory a piece of code added at its peak: ``with PeakRSS() as peak: ...; peak.added``.

    Linux keeps the process's resident high-water mark (``VmHWM``); writing 5 to
    ``/proc/self/clear_refs`` resets it to the current RSS, so the mark after the code, less
    the RSS before it, is that code's peak, however much the process held before. ``added``
    is None where the mark cannot be read or reset (not Linux, a restricted ``/proc``).
    """

    def __init__(self) -> None:
        self.before: int | None = None
        self.added: int | None = None

    def __enter__(self) -> PeakRSS:
        self.before = _status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.before = None
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _status_bytes("VmHWM")
        if self.before is not None and peak is not None:
            self.added = max(0, peak - self.before)
