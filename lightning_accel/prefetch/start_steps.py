"""Which of the first steps measure the start: after the warm-up, none that starting workers disturbed.

The first ``warmup_steps`` carry worker start-up, or without workers the epoch's set-up
(drawing its order, first file opens), in their wait; measured under load, keeping the
first one made a 2-sample start's spread so wide (62 vs 312 ms) that a 2x faster
candidate looked like noise. While a candidate's workers are being started in the
background, the steps are disturbed too: each fork holds the interpreter's lock
(measured: a 30 ms step with 1 ms items waited ~100 ms while 8 workers started, and
looked data-bound). Two clean steps that each waited longer than they computed are
enough to call a run data-bound; otherwise ``trial_steps`` clean steps decide.
"""

from __future__ import annotations

from lightning_accel.prefetch.wait_meter import WaitMeter

__all__ = ["StartSteps"]


class StartSteps:
    """The steps of ``meter`` that measure the loader's start."""

    def __init__(self, meter: WaitMeter, warmup_steps: int, trial_steps: int) -> None:
        self.meter, self.skip, self.trial_steps = meter, warmup_steps, trial_steps
        self.disturbed: set[int] = set()  # steps a background start of workers disturbed

    def note(self, starting: bool) -> None:
        """Called at each batch arrival and step end: workers ``starting`` now disturb this step and the next one's wait."""
        if starting:
            self.disturbed.update((len(self.meter) - 1, len(self.meter)))

    def clean(self, stop: int | None = None, strict: bool = False) -> list[int]:
        """The measured steps (after the warm-up, before ``stop``) no background start disturbed;
        unless ``strict``, all of them when fewer than two are left (the candidate took over first),
        and the warm-up steps when none is (workers started while the first batch loaded took
        over after it, or, where the loop reads a batch ahead, even with the batch the warm-up
        step's wait fetched; their own measurement of the items then restates the start before
        the verdict: ``OnlineSearch._verify_start``)."""
        end = len(self.meter) if stop is None else stop
        steps = range(self.skip, end)
        clean = [i for i in steps if i not in self.disturbed]
        if strict or len(clean) >= min(2, self.trial_steps):
            return clean
        return list(steps) if len(steps) else list(range(min(self.skip, len(self.meter))))

    def clearly_data_bound(self) -> bool:
        """No need to measure more: two steps that each waited longer than they computed."""
        clean = self.clean(strict=True)
        return len(clean) >= 2 and all(self.meter.waits[i] > self.meter.steps[i] for i in clean)

    def enough(self) -> bool:
        """Measured enough to decide whether the run is data-bound."""
        return len(self.clean(strict=True)) >= self.trial_steps or self.clearly_data_bound()
