"""A multi-process test's rendezvous store, held by the test as torchrun's agent holds it, so no port race is possible."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore


def held_store(timeout_s: float = 300.0) -> TCPStore:
    """The ranks' store, bound to a port the kernel picks and kept until the test drops it. Lightning's rendezvous (and
    a test that picks a free port itself) finds a free port, closes it, and rank 0 binds it again later; in between
    another run on the machine can take it, and its ranks and ours then meet in one store (one connects, leaves, and
    ours fail with gloo's "Connection closed by peer"). A bound port cannot be taken by anyone else."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def store_env(store: TCPStore) -> dict[str, str]:
    """What a rank's environment needs to meet in ``store``: every rank is its client (torch's env:// rendezvous
    with an agent's store), and Lightning reads the port as its own."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
