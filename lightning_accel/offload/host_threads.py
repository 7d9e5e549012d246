"""CPU threads for the host optimizer step and the host-side copies, within the rank's budget.

torch sizes its intra-op pool from the machine (OpenMP's default), not from what this
rank may use: under ``taskset``, a cgroup quota, ``SLURM_CPUS_PER_TASK=1`` or with eight
ranks on two cores, every rank's fused optimizer kernel and fp32->bf16 shadow refresh
would fan out over all cores and the ranks would fight for them (reported 10x slower).
:class:`HostThreads` takes the budget from :func:`lightning_accel.cpu_budget.cpu_budget`
and

- lowers the intra-op threads of the calling (main) thread to it, where the copies and
  the non-overlapped host step run; a lower count the user set (``torch.set_num_threads``,
  ``OMP_NUM_THREADS``) is kept;
- gives every host-step worker thread the same count through :meth:`init_worker`, the
  ``ThreadPoolExecutor`` initializer: torch fixes a thread's intra-op count when the
  thread first runs a parallel kernel, so a worker started earlier would not follow a
  later ``torch.set_num_threads`` of the main thread;
- lowers the inter-op pool the same way where torch still allows it (only before any
  inter-op work has started);
- puts the main thread's intra-op count back on :meth:`restore`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_accel.cpu_budget import CpuBudget, cpu_budget


@dataclass
class HostThreads:
    """The thread counts chosen for one run, and the ones to put back."""

    budget: CpuBudget
    threads: int  # intra-op threads of the main thread and of every host-step worker
    previous: int
    interop: int | None = None  # the inter-op pool's size, where we lowered it (torch allows it once)

    @classmethod
    def plan(cls, budget: CpuBudget | None = None) -> HostThreads:
        """Threads within ``budget`` (default: this rank's, from :func:`cpu_budget`)."""
        budget = cpu_budget() if budget is None else budget
        current = torch.get_num_threads()
        return cls(budget, min(current, budget.cores), current)

    def apply(self) -> None:
        torch.set_num_threads(self.threads)
        interop = torch.get_num_interop_threads()
        if interop > self.budget.cores:
            try:
                torch.set_num_interop_threads(self.budget.cores)
            except RuntimeError:  # the pool has started; torch allows setting it once, before that
                return
            self.interop = self.budget.cores

    def init_worker(self) -> None:
        """``ThreadPoolExecutor(initializer=...)`` for the host-step and delayed-update threads."""
        torch.set_num_threads(self.threads)

    def restore(self) -> None:
        torch.set_num_threads(self.previous)

    def describe(self) -> str:
        kept = f" (kept the {self.previous} already set)" if self.previous < self.budget.cores else ""
        return f"host step and copies on {self.threads} intra-op thread{'s' if self.threads != 1 else ''}{kept}; budget {self.budget}"
