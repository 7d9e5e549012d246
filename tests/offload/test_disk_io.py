"""The tier's disk path: O_DIRECT spans through aligned buffers, scratch directories of their own, the stand-in keys."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from lightning_accel.offload import disk_io, tier_dir
from lightning_accel.offload.disk_io import ALIGN, DirectFile, DiskFull, DiskIO, IOCounters, aligned_buffer
from lightning_accel.offload.state_keys import per_element_state


def test_spans_go_to_the_file_and_back_in_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_io, "CHUNK", 3 * ALIGN)  # several requests per span, the last one short
    counters = IOCounters()
    io = DiskIO(counters, threads=3)
    size = 10 * ALIGN + 123
    out, back = aligned_buffer(size), aligned_buffer(size)
    assert out.data_ptr() % ALIGN == 0 and out.numel() == 11 * ALIGN
    out.copy_(torch.randint(0, 256, (out.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    file = DirectFile(str(tmp_path / "unit.bin"), size)
    try:
        assert os.path.getsize(file.path) == 11 * ALIGN  # preallocated, aligned
        io.wait(io.write(file, out, 0, size))
        io.wait(io.read(file, back, 0, size))
        assert torch.equal(out, back)
        back.zero_()
        io.wait(io.read(file, back[ALIGN:], 2 * ALIGN, 4 * ALIGN))  # a span inside the file, into the middle of a buffer
        assert torch.equal(back[ALIGN:5 * ALIGN], out[2 * ALIGN:6 * ALIGN]) and not back[:ALIGN].any()
    finally:
        file.close()
        io.close()
    assert counters.write_bytes == 11 * ALIGN and counters.read_bytes == 15 * ALIGN


def test_a_failed_request_fails_the_span(tmp_path: Path) -> None:
    io = DiskIO(IOCounters())
    file = DirectFile(str(tmp_path / "unit.bin"), ALIGN)
    file.close()  # a closed descriptor: every request fails
    with pytest.raises(OSError):
        io.wait(io.read(file, aligned_buffer(ALIGN), 0, ALIGN))
    io.close()


def test_a_disk_without_room_fails_at_preallocation_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskFull, match=r"^strategy.nvme_path: no room in '.*' for the NVMe tier: it needs 8,192 bytes \(8.19 kB\) "
                                        r"and .* is free there; free that much, point nvme_path at a larger disk, or raise "
                                        r"host_budget so that less goes to disk$"):
        DirectFile(str(tmp_path / "unit.bin"), 5000)
    assert not (tmp_path / "unit.bin").exists()


def test_each_run_gets_its_own_directory_and_a_dead_runs_is_removed(tmp_path: Path) -> None:
    first, second = tier_dir.make_run_dir(str(tmp_path / "nvme")), tier_dir.make_run_dir(str(tmp_path / "nvme"))
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    owner = json.loads(Path(first, tier_dir.OWNER).read_text())
    assert owner["pid"] == os.getpid()
    Path(second, tier_dir.OWNER).write_text(json.dumps({**owner, "pid": 2**22 + 12345}))  # a pid no process has
    elsewhere = tmp_path / "nvme" / f"{tier_dir.PREFIX}other-host"
    elsewhere.mkdir()
    (elsewhere / tier_dir.OWNER).write_text(json.dumps({**owner, "host": "another-host", "pid": 2**22 + 12345}))
    assert tier_dir.remove_stale(str(tmp_path / "nvme")) == [second]
    assert os.path.isdir(first) and os.path.isdir(elsewhere)


def test_a_file_as_nvme_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^strategy.nvme_path='.*f' is a file; give a directory on a fast local disk$"):
        tier_dir.make_run_dir(str(tmp_path / "f"))


@pytest.mark.parametrize(("optimizer", "keys"), [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), ("exp_avg", "exp_avg_sq")),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), ()),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",)),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5, centered=True), ("square_avg", "momentum_buffer", "grad_avg")),
])
def test_the_per_element_state_is_found_by_a_stand_in(optimizer: object, keys: tuple[str, ...]) -> None:
    param = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.float64))
    found = per_element_state(optimizer([param]), [param], {param: torch.float64})  # type: ignore[operator]
    assert found[param] == tuple((k, torch.float64) for k in keys)
