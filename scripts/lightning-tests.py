#!/usr/bin/env python
"""Lightning's own tests as a peer suite: ``tests_pytorch`` run with our strategies in place of the one Lightning picks.

Usage (not part of CI; fetches nothing: give it a local copy of Lightning's ``tests/`` folder, the release matching the
installed ``lightning``, e.g. ``git archive 2.6.5 tests/tests_pytorch | tar -x -C /work/lightning-tests``)::

    nice -n 10 python scripts/lightning-tests.py /work/lightning-tests/tests trainer/optimization loops callbacks \\
        --strategy l2l_offload --strategy gpipe --out lightning-tests.json

Each path (under ``tests_pytorch``) runs once per ``--strategy`` with the swap: where the ``Trainer`` is left to choose
(``strategy="auto"``) and Lightning would pick ``SingleDeviceStrategy``, our strategy is built instead
(:func:`_install_swap`, a patch of the accelerator connector's ``_choose_strategy``), and once as the reference, the
strategy ours stands in for, swapped in the same way (:data:`REFERENCE`): for ``l2l_offload`` and ``gpipe`` Lightning's
own choice (the tests as Lightning ships them); for ``l2l_offload_ddp``, ``DDPStrategy`` on 2 CPU processes. Both DDP
strategies launch their ranks by :class:`_ForkRankLauncher`: rank 0 is the test's own process (its mocks, callbacks and
assertions see rank 0, as in Lightning's own standalone DDP tests), rank 1 a fork of it for the length of the call
(Lightning's launchers would run the pytest command again, or every rank in a child).
Each test that passes in its reference and had the swap is then one of:

- **equal**: it passes with our strategy too (Lightning's own assertions hold);
- **refused**: it fails with one of our one-line refusals (a ValueError / TypeError raised in ``lightning_accel``), the
  line given (whether before the first step is not checked here; the conformance suite checks that);
- **checks internals**: its assertion is about Lightning's machinery rather than what the user gets (the strategy's
  class, a mock of a Lightning method's calls, threads left alive); which one is given;
- **difference**: anything else, the first line of the error given.

Tests where no swap happened (they choose their own strategy or build no Trainer), or that fail or skip in the
reference, are counted apart.

    nice -n 10 python scripts/lightning-tests.py /work/lightning-tests/tests trainer/optimization \\
        --strategy l2l_offload_ddp --out lightning-tests-ddp   # against DDP, 2 forked CPU processes per fit ``--table`` prints the markdown summary kept in docs/lightning-features.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

DEFAULT_PATHS = ["trainer/optimization", "loops", "callbacks"]
# the run each strategy is compared with: Lightning's own choice (no swap), or DDP on 2 processes for the DDP strategy
REFERENCE = {"l2l_offload": "reference", "gpipe": "reference", "l2l_offload_ddp": "ddp"}
RANKS = 2  # processes of the ddp and l2l_offload_ddp swaps
PER_TEST_SECONDS = 60  # a test that hangs under a strategy fails as a difference instead of stopping the run
# tests that choose a multi-process strategy themselves, or spawn processes (the swap never happens there), are left
# out: they only cost time (test_spike.py's integration test: 50 s each on 2 cores)
DEFAULT_KEYWORDS = "not ddp and not spawn and not fsdp and not deepspeed and not spike_detection_integration"

# What a failing test's assertion is about when it checks Lightning's machinery, not the user's results: (pattern in
# the failure text, the reason given). The first match wins; everything else is a difference.
INTERNALS = [
    (r"isinstance\(\w*\.?strategy, \w+\)|type\(\w*\.?strategy\)|strategy\.__class__|SingleDeviceStrategy",
     "the strategy's class"),
    (r"(assert_called|assert_not_called|assert_has_calls|call_count|call_args|mock_calls|called_once)",
     "the calls of a mocked Lightning method"),
    (r"patch\(\"time\.(perf_counter|monotonic|time)\"", "mocks the process's clock with a fixed list of readings (the "
     "offload's own timing reads it too)"),
    (r"_thread_police|thread.*(alive|leak)|threads? (left|still)", "threads left alive (the host-step pool)"),
    (r"_accelerator_connector|_strategy_flag|precision_plugin\b.*is\b", "the accelerator connector's choices"),
]


# -- inside pytest ------------------------------------------------------------------------------------------------------

class _Recorder:
    """A pytest plugin: the swap (if any), a per-test time limit, and one JSON line per test."""

    def __init__(self, strategy: str | None, results: Path) -> None:
        self.strategy = strategy
        self.out = results.open("w")
        self.swaps = [0]
        if strategy is not None:
            _install_swap(strategy, self.swaps)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.swaps[0] = 0
        self.started = time.perf_counter()
        self.report: dict[str, Any] = {"test": nodeid, "outcome": "passed"}
        if hasattr(signal, "SIGALRM"):
            signal.signal(signal.SIGALRM, _timed_out)
            signal.alarm(PER_TEST_SECONDS)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.outcome == "skipped" and report.when in ("setup", "call"):
            self.report["outcome"] = "skipped"
        elif report.failed and self.report["outcome"] != "failed":
            self.report["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            crash = getattr(report.longrepr, "reprcrash", None)
            self.report["message"] = (crash.message if crash is not None else str(report.longrepr)).strip()
            text = report.longreprtext  # the test's source (its mocks) at the head, where it failed at the tail
            self.report["text"] = text if len(text) < 12000 else text[:6000] + "\n...\n" + text[-6000:]

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
        self.report["swapped"] = self.swaps[0] > 0
        self.report["seconds"] = round(time.perf_counter() - self.started, 2)
        self.out.write(json.dumps(self.report) + "\n")
        self.out.flush()


def _timed_out(*_: Any) -> None:
    raise TimeoutError(f"the test ran past {PER_TEST_SECONDS} s (a hang?)")


class _ForkRankLauncher:
    """Rank 0 in this process, the other ranks forked from it for one ``fit``/``validate``/... call (see the module doc).

    Each call gets a fresh process group (a forked rank lives for one call), as Lightning's fork and spawn launchers give;
    a group the strategy made beside it goes with it (``l2l_offload_ddp``'s gloo group for host tensors: under those
    launchers it is made in the ranks, never in the test's process, so a second call of the same Trainer makes it anew).
    A rank that fails makes rank 0's collectives time out (the strategies get a 60 s timeout) or raise; rank 0 failing
    kills the others, and a forked rank still running past the test's time limit is killed by the kernel."""

    is_interactive_compatible = False

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        import torch.distributed as dist

        os.environ.pop("MASTER_PORT", None)  # (the tests' fixtures restore the environment after each test)
        self.strategy.cluster_environment.main_port  # a free port, chosen once, before the fork: every rank's
        children = []
        for rank in range(1, self.strategy.num_processes):
            pid = os.fork()
            if pid == 0:  # a rank: run the call, then leave without returning into pytest
                code = 1
                try:
                    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # killed, even inside a blocking collective
                    signal.alarm(PER_TEST_SECONDS)
                    os.environ["LOCAL_RANK"] = str(rank)
                    self.strategy.set_world_ranks()
                    function(*args, **kwargs)
                    code = 0
                finally:
                    os._exit(code)
            children.append(pid)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            raise
        finally:
            codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
            if dist.is_initialized():
                dist.destroy_process_group()
            if getattr(self.strategy, "_host_group", None) is not None:
                self.strategy._host_group = None
        if any(codes):
            raise RuntimeError(f"rank(s) {[r + 1 for r, c in enumerate(codes) if c]} of the forked ranks failed (exit codes {codes})")
        return result

    def kill(self, signum: int) -> None:
        pass


def _install_swap(strategy: str, swaps: list[int]) -> None:
    """Where Lightning would pick ``SingleDeviceStrategy`` for a ``Trainer`` left to choose, build ``strategy``."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_accel.strategies import GPipeStrategy, L2LOffloadDDPStrategy, L2LOffloadStrategy

    choose = _AcceleratorConnector._choose_strategy

    def ours(self: Any) -> Any:
        chosen = choose(self)
        if type(chosen) is not SingleDeviceStrategy:
            return chosen
        swaps[0] += 1
        device = chosen.root_device
        if strategy == "l2l_offload":
            return L2LOffloadStrategy(device=device if device.type != "cpu" else None)
        if strategy == "gpipe":
            return GPipeStrategy()  # what strategy="gpipe" builds: the visible GPUs' stages, else the CPU
        # RANKS processes on this host: the CPU, or one GPU each; forked where the test's Trainer runs (see the doc)
        ranks = [device] * RANKS if device.type == "cpu" else [torch.device(device.type, i) for i in range(RANKS)]
        if strategy not in ("ddp", "l2l_offload_ddp"):
            raise ValueError(f"--strategy {strategy!r}: use one of {', '.join(REFERENCE)}")
        kind = DDPStrategy if strategy == "ddp" else L2LOffloadDDPStrategy
        made = kind(parallel_devices=ranks, timeout=timedelta(seconds=PER_TEST_SECONDS))
        made._configure_launcher = lambda: setattr(made, "_launcher", _ForkRankLauncher(made))  # (an instance's own)
        return made

    _AcceleratorConnector._choose_strategy = ours  # type: ignore[method-assign]


def _run_pytest(tests: Path, paths: list[str], keywords: str, strategy: str | None, results: Path) -> int:
    import pytest

    os.chdir(tests)
    sys.path.insert(0, str(tests))
    targets = [str(Path("tests_pytorch") / p) for p in paths]
    return int(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-k", keywords, *targets],
                           plugins=[_Recorder(strategy, results)]))


# -- the comparison ---------------------------------------------------------------------------------------------------

def _load(path: Path) -> dict[str, dict[str, Any]]:
    return {r["test"]: r for r in map(json.loads, path.read_text().splitlines()) if r}


def classify(reference: dict[str, Any], swapped: dict[str, Any] | None, strategy: str) -> tuple[str, str]:
    """(class, detail) of one test; see the module doc."""
    if reference["outcome"] != "passed":
        return "not passing in the reference", reference["outcome"]
    if swapped is None:
        return "not run", ""
    if not swapped["swapped"]:
        return "no swap", ""
    if swapped["outcome"] == "passed":
        return "equal", ""
    if swapped["outcome"] == "skipped":
        return "difference", "skipped with the swap"
    message = swapped.get("message", "").splitlines()[0] if swapped.get("message") else swapped["outcome"]
    text = swapped.get("text", "")
    # our refusals are raised by our code as ValueError / TypeError / UserError naming the fix (an AssertionError or a
    # KeyError there is a crash: a difference)
    # (raised inside the test's ``pytest.warns`` it comes chained, "DID NOT WARN" on top)
    raised_here = re.search(r"lightning_accel/[\w/]+\.py:\d+: (ValueError|TypeError|\w*UserError)$", text, re.MULTILINE) is not None
    # the last such line: a refusal raised while handling another error comes after it (its cause) in the text
    refusal = ([None] + list(re.finditer(r"^E\s+((ValueError|TypeError|\w*UserError): .*)$", text, re.MULTILINE)))[-1]
    if raised_here and refusal is not None:
        return "refused", refusal.group(1)
    for pattern, reason in INTERNALS:
        if re.search(pattern, text):
            return "checks internals", reason
    return "difference", message


def compare(out: dict[str, Path], strategies: list[str]) -> dict[str, dict[str, tuple[str, str]]]:
    table: dict[str, dict[str, tuple[str, str]]] = {}
    for strategy in strategies:
        reference, runs = _load(out[REFERENCE[strategy]]), _load(out[strategy])
        table[strategy] = {test: classify(ref, runs.get(test), strategy) for test, ref in reference.items()}
    return table


def markdown(table: dict[str, dict[str, tuple[str, str]]], paths: list[str], detail: bool) -> str:
    import lightning
    import torch

    classes = ["equal", "refused", "checks internals", "difference", "no swap", "not passing in the reference", "not run"]
    against = {"reference": "Lightning's choice", "ddp": f"DDP, {RANKS} processes"}
    lines = [f"tests_pytorch/{{{','.join(paths)}}} of the copy given; lightning {lightning.__version__} and torch "
             f"{torch.__version__} installed:", "",
             "| strategy | reference | " + " | ".join(classes) + " |", "|---|---|" + "---|" * len(classes)]
    for strategy, rows in table.items():
        counts = Counter(c for c, _ in rows.values())
        lines.append(f"| `{strategy}` | {against[REFERENCE[strategy]]} | "
                     + " | ".join(str(counts.get(c, 0)) for c in classes) + " |")
    if detail:
        for strategy, rows in table.items():
            for kind in ("refused", "checks internals", "difference"):
                grouped = Counter(d for c, d in rows.values() if c == kind)
                if grouped:
                    lines += ["", f"`{strategy}`, {kind}:"]
                    lines += [f"- {n} x {d[:200]}" for d, n in grouped.most_common()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="a local copy of Lightning's tests/ folder (it holds tests_pytorch)")
    parser.add_argument("paths", nargs="*", default=DEFAULT_PATHS, help=f"under tests_pytorch (default: {DEFAULT_PATHS})")
    parser.add_argument("--strategy", action="append", choices=list(REFERENCE), help="default: l2l_offload")
    parser.add_argument("-k", dest="keywords", default=DEFAULT_KEYWORDS, help=f"pytest's -k (default: {DEFAULT_KEYWORDS!r})")
    parser.add_argument("--out", type=Path, default=Path("lightning-tests"), help="a folder for the per-test JSON lines")
    parser.add_argument("--compare-only", action="store_true", help="classify the results already in --out")
    parser.add_argument("--detail", action="store_true", help="list each refusal, internal check and difference")
    parser.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    strategies = args.strategy or ["l2l_offload"]
    tests = args.tests.resolve()
    if not (tests / "tests_pytorch").is_dir():
        parser.error(f"{tests} holds no tests_pytorch folder; give the tests/ folder of a copy of Lightning's repository")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args._run is not None:  # (the child process: one pytest run)
        return _run_pytest(tests, args.paths, args.keywords, None if args._run == "reference" else args._run, out / f"{args._run}.jsonl")
    references = list(dict.fromkeys(REFERENCE[s] for s in strategies))
    files = {mode: out / f"{mode}.jsonl" for mode in [*references, *strategies]}
    if not args.compare_only:
        for mode in files:
            started = time.perf_counter()
            cmd = [sys.executable, __file__, str(tests), *args.paths, "-k", args.keywords, "--out", str(out), "--_run", mode]
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            print(f"{mode}: {len(_load(files[mode]))} tests in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    table = compare(files, strategies)
    (out / "classes.json").write_text(json.dumps(table, indent=1))
    print(markdown(table, args.paths, args.detail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
