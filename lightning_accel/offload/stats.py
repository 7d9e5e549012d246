"""What the offload moved and how long it took, per step and in total."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class OffloadStats:
    """Counters the executor updates; ``per_step`` values are for the last optimizer step.

    ``overlap_fraction`` is the share of copy time the compute did not wait for
    (1.0: every copy was hidden behind compute; 0.0: compute waited for all of it). On a
    CPU "device" copies are synchronous, so it is 0.
    """

    steps: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    peak_device_bytes: int = 0
    peak_resident_blocks: int = 0
    h2d_bytes_per_step: int = 0
    d2h_bytes_per_step: int = 0
    # blocks whose optimizer step ran on the host while the backward pass went on
    blocks_stepped_in_backward: int = 0
    # optimizer calls those steps took (blocks whose gradients landed together share one)
    host_step_calls: int = 0
    # host updates deferred to run one step late, beside the next step's compute (delayed_update)
    delayed_steps: int = 0
    # block-boundary activations parked in host memory between forward and backward
    # (offload_activations): bytes sent to the host, and brought back for the recompute
    activation_d2h_bytes: int = 0
    activation_h2d_bytes: int = 0
    activation_d2h_bytes_per_step: int = 0
    # parameters in the offloaded units (blocks, and the resident unit when it streams)
    offloaded_params: int = 0
    # everything the host keeps for them: frozen tensors as stored, fp32 masters, low-precision
    # shadows, gradient buffers and the pinned rings the copies cross (see HostStore.host_bytes, staging.py)
    host_bytes: int = 0
    # the optimizer state of the host parameters (Adam: two fp32 moments each), once it exists
    host_optimizer_bytes: int = 0
    # the largest host_bytes seen (with the NVMe tier: what stayed in memory, its I/O buffers included)
    peak_host_bytes: int = 0
    # the NVMe tier (strategy nvme_path / host_budget): bytes of optimizer state and masters in its files,
    # bytes read and written (in total), and seconds the step waited on the disk
    nvme_bytes: int = 0
    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0
    nvme_seconds: float = 0.0

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_bytes / self.offloaded_params if self.offloaded_params else 0.0

    @property
    def overlap_fraction(self) -> float:
        if self.copy_seconds <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.wait_seconds / self.copy_seconds))

    def as_metrics(self, prefix: str = "offload/") -> dict[str, float]:
        out = {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in fields(self)}
        out[f"{prefix}overlap_fraction"] = self.overlap_fraction
        out[f"{prefix}host_bytes_per_param"] = self.host_bytes_per_param
        return out

    def summary(self) -> str:
        gib = 1024**3
        line = (
            f"L2L offload: {self.steps} steps, {self.h2d_bytes_per_step / gib:.3f} GiB host->device and "
            f"{self.d2h_bytes_per_step / gib:.3f} GiB device->host per step, copies {self.copy_seconds:.2f} s "
            f"({self.overlap_fraction:.0%} hidden behind compute), peak {self.peak_resident_blocks} blocks / "
            f"{self.peak_device_bytes / 2**20:.1f} MiB of block weights on the device, "
            f"{self.host_bytes / gib:.3f} GiB on the host for {self.offloaded_params:,} parameters "
            f"({self.host_bytes_per_param:.2f} B each) + {self.host_optimizer_bytes / gib:.3f} GiB of optimizer state"
        )
        if self.activation_d2h_bytes:
            line += f", {self.activation_d2h_bytes_per_step / gib:.3f} GiB of boundary activations parked on the host per step"
        if self.nvme_bytes:
            line += (f", {self.nvme_bytes / gib:.3f} GiB on disk ({self.nvme_read_bytes / gib:.3f} GiB read, "
                     f"{self.nvme_write_bytes / gib:.3f} GiB written, {self.nvme_seconds:.2f} s waiting on the disk)")
        if self.delayed_steps:
            line += f", {self.delayed_steps} host updates applied one step late"
        return line
