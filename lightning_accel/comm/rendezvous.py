"""A rendezvous store that the process starting the ranks holds, so that no port race is possible."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore

__all__ = ["held_store", "store_env"]


def held_store(timeout_s: float = 300.0) -> TCPStore:
    """The ranks' store, bound to a port the kernel picks and held by the launching process (as torchrun's agent holds
    it) until it drops it. A launcher that finds a free port, closes it and lets rank 0 bind it again later (Lightning's,
    a hand-written one) leaves a gap in which another job on the machine can take the port; its ranks and ours then
    meet in one store (one connects, leaves, and ours fail with gloo's "Connection closed by peer"). A bound port
    cannot be taken by anyone else."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def store_env(port: int) -> dict[str, str]:
    """What a rank's environment needs to meet in the store held on ``port``: every rank is its client (torch's env://
    rendezvous with an agent's store, ``TORCHELASTIC_USE_AGENT_STORE``), and Lightning reads the port as its own."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
