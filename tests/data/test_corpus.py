"""The stdlib corpus: content checked against the source files read directly, caching, atomicity."""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

import pytest

from lightning_accel.data import corpus
from lightning_accel.data.corpus import default_cache_dir, stdlib_corpus

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HEADER = re.compile(rb"\n# ---- (\S+)\n")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never write into the user's home, even if a test forgets cache_dir.
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE", str(tmp_path / "env-cache"))


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The corpus at the default max_bytes, built once for the module (~1 s)."""
    return stdlib_corpus(tmp_path_factory.mktemp("corpus")).read_bytes()


def _sections(data: bytes) -> list[tuple[str, bytes]]:
    """Split the corpus at its headers into (relpath, body) pairs."""
    parts = HEADER.split(data)
    assert parts[0] == b"", "the corpus must start with a header"
    return [(parts[i].decode(), parts[i + 1]) for i in range(1, len(parts), 2)]


def test_default_corpus_is_the_sorted_stdlib_sources_up_to_max_bytes(default_corpus: bytes) -> None:
    assert 8_000_000 - 4 <= len(default_corpus) <= 8_000_000  # fills the budget, cut on a UTF-8 boundary
    default_corpus.decode("utf-8")  # valid UTF-8 throughout
    sections = _sections(default_corpus)
    names = [name for name, _ in sections]
    assert names == sorted(names)
    assert {"abc.py", "os.py"} <= set(names)
    for name in names:
        parts = Path(name).parts[:-1]
        assert not {"test", "tests", "site-packages", "idlelib"} & set(parts), name
    # Every body equals the file as read from disk; the last one is a prefix of it.
    for name, body in sections[:-1]:
        expected = (STDLIB / name).read_bytes().decode("utf-8", errors="replace").encode()
        assert body == expected, name
    last_name, last_body = sections[-1]
    assert (STDLIB / last_name).read_bytes().startswith(last_body)


def test_os_source_appears_verbatim(default_corpus: bytes) -> None:
    import os as os_module

    source = Path(os_module.__file__).read_bytes()
    assert b"\n# ---- os.py\n" + source in default_corpus
    assert b"def makedirs(" in default_corpus


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    a = stdlib_corpus(tmp_path / "a", max_bytes=300_000).read_bytes()
    b = stdlib_corpus(tmp_path / "b", max_bytes=300_000).read_bytes()
    assert a == b
    assert len(a) <= 300_000


def test_second_call_returns_the_cache_without_rebuilding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = stdlib_corpus(tmp_path, max_bytes=100_000)
    mtime = first.stat().st_mtime_ns

    def fail(*args: object) -> bytes:
        raise AssertionError("rebuilt a cached corpus")

    monkeypatch.setattr(corpus, "_build", fail)
    second = stdlib_corpus(tmp_path, max_bytes=100_000)
    assert second == first
    assert second.stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError, match="rebuilt"):
        stdlib_corpus(tmp_path, max_bytes=100_001)  # a different key does build


def test_cache_key_separates_sizes_and_no_temp_files_remain(tmp_path: Path) -> None:
    small = stdlib_corpus(tmp_path, max_bytes=10_000)
    large = stdlib_corpus(tmp_path, max_bytes=20_000)
    assert small != large
    assert large.read_bytes().startswith(small.read_bytes()[:9_000])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([small.name, large.name])


def test_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        stdlib_corpus(tmp_path, max_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    assert stdlib_corpus(max_bytes=5_000).parent == tmp_path / "elsewhere"
    monkeypatch.delenv("LIGHTNING_ACCEL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_accel"


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_max_bytes_is_rejected(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=r"max_bytes=.* is not a positive integer; pass data.max_bytes="):
        stdlib_corpus(tmp_path, max_bytes=bad)  # type: ignore[arg-type]
