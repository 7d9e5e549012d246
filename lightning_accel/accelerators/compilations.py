"""Counting XLA graph compilations, to see that step boundaries keep the graphs stable.

torch_xla traces each step into a graph and compiles every graph it has not seen; a
training loop with correct step boundaries compiles a handful of graphs in its first
steps and then none. A count that keeps rising means a graph changes every step (a
shape that varies, a Python value baked in, a missing ``torch_xla.sync()``).
"""

from __future__ import annotations


def compile_count() -> int:
    """How many XLA graphs this process has compiled so far (0 before the first)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


class CompileLog:
    """The compile count after each optimizer step: ``counts[i]`` is the total after step ``i + 1``."""

    def __init__(self) -> None:
        self.start = 0
        self.counts: list[int] = []

    def begin(self) -> None:
        self.start = compile_count()
        self.counts = []

    def record(self) -> int:
        self.counts.append(compile_count() - self.start)
        return self.counts[-1]

    @property
    def total(self) -> int:
        return self.counts[-1] if self.counts else 0

    def since(self, step: int) -> int:
        """Compilations after optimizer step ``step`` (1-based); 0 when the graphs are stable."""
        if len(self.counts) <= step:
            return 0
        return self.counts[-1] - self.counts[step - 1]

    def summary(self) -> str:
        steps = len(self.counts)
        if steps < 4:
            return f"xla: {self.total} graphs compiled in {steps} steps"
        # Warm-up compiles the first step, the steady step, the first validation and
        # checkpoint and the first epoch end; the last step may add Lightning's end-of-fit
        # bookkeeping. In the last third before it, a stable loop compiles nothing.
        first = steps - steps // 3
        late = self.counts[-2] - self.counts[first - 2]
        verdict = "stable" if late == 0 else "RECOMPILING: a graph changes between steps (varying shapes or Python values?)"
        return f"xla: {self.total} graphs compiled in {steps} steps, {late} of them in steps {first}-{steps - 1} ({verdict})"
