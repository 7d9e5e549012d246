"""A warm Python for the tests' subprocesses: ``python script.py`` and ``python -m module`` started by forking a process
that has already imported torch and Lightning, instead of a fresh interpreter that spends ~7 s of CPU importing them.

Why: the suite starts ~150 Python processes (CLI runs, user scripts and the ranks Lightning launches from them), and on
CI's two cores their imports were a third of its time. A zygote (Android's word; Chromium and Ruby's spring do the
same) imports once; :func:`WarmPython.executable` is a small launcher script the tests use in place of
``sys.executable``. The launcher hands its argv, environment, working directory, CPU affinity and standard streams to
the zygote over a Unix socket; the zygote forks a child that becomes that process (streams dup'ed onto 0-2, the
environment replaced, ``sys.path`` rebuilt, torch's thread count and Lightning's rank read from the new environment) and
runs the script or module as ``__main__``. The launcher forwards signals to it and exits with its status, a signal
death included, so ``Popen.returncode``, ``proc.kill()`` and a process-group kill of the launcher behave as they do
for a fresh interpreter (the child kills itself when its launcher's socket closes). Lightning's launcher starts other
ranks with ``sys.executable``: in a warm child that is the launcher again, so they are warm too.

Anything else (``-c``, interpreter options, no zygote) runs the real interpreter, unchanged. Not for tests of what a
fresh process imports or of what the interpreter reads once at start-up (``MALLOC_*``, ``PYTHONHASHSEED``): they use
``sys.executable``.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

__all__ = ["WarmPython", "python"]

PRELOAD = ("torch", "lightning.pytorch", "hydra", "lightning_accel", "lightning_accel.cli", "lightning_accel.runner")
# the extras most workers build with (a tiny Llama, LoRA): ~3 s more each, where installed
PRELOAD_IF_INSTALLED = ("transformers.models.llama.modeling_llama", "peft")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

# The launcher: the real interpreter with -I -S (no site, no user paths: ~20 ms), standard library only.
LAUNCHER = '''#!{python} -IS
import json, os, signal, socket, sys
REAL, SOCK = {python!r}, {sock!r}
args = sys.argv[1:]
if len(args) >= 2 and args[0] == "-m":
    kind, target, rest = "module", args[1], args[2:]
elif args and not args[0].startswith("-"):
    kind, target, rest = "script", args[0], args[1:]
else:
    os.execv(REAL, [REAL, *args])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(SOCK)
except OSError:
    os.execv(REAL, [REAL, *args])
request = {{"kind": kind, "target": target, "argv": rest, "cwd": os.getcwd(), "env": dict(os.environ),
           "affinity": sorted(os.sched_getaffinity(0)), "executable": sys.argv[0]}}
socket.send_fds(conn, [json.dumps(request).encode() + b"\\n"], [0, 1, 2])
reader = conn.makefile("r")
pid = int(reader.readline())
for sig in {forwarded}:
    signal.signal(sig, lambda s, _f: os.kill(pid, s))
line = reader.readline().split()
if not line:
    sys.exit(1)
if line[0] == "signal":
    if int(line[1]) not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(int(line[1]), signal.SIG_DFL)
    os.kill(os.getpid(), int(line[1]))
sys.exit(int(line[1]))
'''


class WarmPython:
    """The zygote, started by :meth:`start` and stopped by :meth:`stop`; :attr:`executable` is its launcher."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = str(directory / "zygote.sock")
        self.executable = str(directory / "python")
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> WarmPython:
        Path(self.executable).write_text(LAUNCHER.format(python=sys.executable, sock=self.socket,
                                                         forwarded="(" + ", ".join(str(int(s)) for s in FORWARDED) + ",)"))
        os.chmod(self.executable, os.stat(self.executable).st_mode | stat.S_IXUSR)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        with open(self.directory / "zygote.log", "wb") as log:  # run as a script: it imports lightning_accel as the children would
            self._server = subprocess.Popen([sys.executable, __file__, self.socket], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            if self._server.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "zygote.log").read_text()[-2000:]
                raise RuntimeError(f"the warm Python's zygote did not start (exit {self._server.poll()}):\n{log}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            self._server.wait(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def serve(path: str) -> None:
    """The zygote: import, listen, fork a child per launcher; the listening socket appears once the imports are done."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_IF_INSTALLED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    sys.stdout.flush(), sys.stderr.flush()
    own = {"", str(Path(__file__).resolve().parent), *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    base_path = [p for p in sys.path if p not in own]
    tmp = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, path)  # appears only when it accepts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        while True:  # reap the waiters that have reported
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not ready:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        if os.fork() == 0:  # the waiter: forks the child, reports its pid and its end to the launcher
            listener.close()
            _wait_for(conn, json.loads(message), fds, base_path)
        conn.close()
        for fd in fds:
            os.close(fd)


def _wait_for(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own, not a fresh process's
    try:
        pid = os.fork()
        if pid == 0:
            _become(conn, request, fds, base_path)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            conn.sendall(f"signal {os.WTERMSIG(status)}\n".encode())
        else:
            conn.sendall(f"exit {os.WEXITSTATUS(status)}\n".encode())
    finally:
        os._exit(0)


def _become(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked child: take the launcher's streams, environment and place, then run its target as ``__main__``."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, as the launcher's fresh interpreter would lead none of the zygote's
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.sched_setaffinity(0, request["affinity"])
        first = str(Path(request["target"]).resolve().parent) if request["kind"] == "script" else os.getcwd()
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *base_path]
        sys.executable = request["executable"]  # Lightning launches the other ranks with it: warm too
        _read_environment()
        threading.Thread(target=_die_with, args=(conn,), daemon=True).start()
        sys.argv = [request["target"], *request["argv"]]
        if request["kind"] == "module":
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["target"], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    _shutdown(code)


def _read_environment() -> None:
    """What a fresh process reads from its environment at import, read again: torch's intra-op threads
    (``OMP_NUM_THREADS``; libgomp read the zygote's at load) and Lightning's rank for its rank-zero logging."""
    import torch
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    rank = fabric_rank_zero._get_rank() or 0
    fabric_rank_zero.rank_zero_only.rank = rank
    pytorch_rank_zero.rank_zero_only.rank = rank


def _die_with(conn: socket.socket) -> None:
    """The launcher gone (killed, its process group killed), the child goes too, as a fresh interpreter would have."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _shutdown(code: int) -> None:
    """The interpreter's own end: wait for non-daemon threads, run atexit, flush; a KeyboardInterrupt ends by SIGINT."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


_zygote: WarmPython | None = None
_starting = threading.Lock()  # threads that launch side by side share one zygote


def python() -> str:
    """The interpreter for a test's ``python script.py`` / ``python -m module``: the warm launcher, its zygote started
    on first use and stopped when this process exits; ``sys.executable`` with ``LIGHTNING_ACCEL_TESTS_COLD=1``."""
    global _zygote
    if os.environ.get("LIGHTNING_ACCEL_TESTS_COLD") == "1" or not hasattr(socket, "send_fds"):
        return sys.executable
    with _starting:
        if _zygote is None:
            _zygote = WarmPython(Path(tempfile.mkdtemp(prefix="warm-python-"))).start()
            atexit.register(_zygote.stop)
    return _zygote.executable


if __name__ == "__main__":
    serve(sys.argv[1])
