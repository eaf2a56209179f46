"""`python -m dptrain ARGS` as a real process, started in milliseconds instead of seconds.

Most of a test's `dptrain train` is start-up: the launching process imports torch (about 2.5 CPU
seconds) before it validates the run and starts its workers. `run_dptrain` forks that process
from the test fork server (tests/distributed.py), which imported torch once, and makes it what
`python -m dptrain` would have been: the command line, working directory, environment, sys.path
(the working directory, then PYTHONPATH, then the interpreter's own), PYTHONDONTWRITEBYTECODE, standard streams (files,
read back as text with universal newlines as subprocess.run(text=True) does; unbuffered when
PYTHONUNBUFFERED is set), exit code (negative: killed by that signal) and interpreter exit
(non-daemon threads joined, atexit handlers run, streams flushed). The process is real: its
workers are started, signalled and reaped by its own launcher, as under a shell.

A command whose environment changes how torch itself starts (TORCH_*, OMP_*, CUDA_*, LD_*, PYTHON*
other than PYTHONPATH and PYTHONUNBUFFERED) runs as a plain subprocess instead: the server's torch
was imported under the test session's environment.
"""

from __future__ import annotations

import io
import json
import locale
import os
import signal
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from multiprocessing import reduction
from pathlib import Path
from typing import Optional, Sequence

from distributed import fork_server

IMPORT_TIME = ("TORCH_", "OMP_", "MKL_", "CUDA_", "LD_", "PYTHON", "KMP_", "GLOO_", "NCCL_")
RUN_TIME_PYTHON = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")


def _startup_sensitive(name: str) -> bool:
    return name.startswith(IMPORT_TIME) and name not in RUN_TIME_PYTHON


def forkable(env: dict[str, str]) -> bool:
    """Whether a process forked from the server would start as a fresh one with `env` does."""
    base = os.environ
    return all(env.get(name) == base.get(name) for name in {*env, *base} if _startup_sensitive(name))


@lru_cache(maxsize=1)
def _interpreter_path() -> tuple[str, ...]:
    """sys.path of a fresh interpreter without PYTHONPATH, less its first entry (the script's directory)."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    listed = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                            env=env, capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.loads(listed.stdout))


def _stream(fd: int, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=locale.getpreferredencoding(False), errors=errors,
                            write_through=unbuffered)


class _Inherited:
    """A file descriptor of ours that the forked process gets too (multiprocessing passes it through the server)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _inherit, (reduction.DupFd(self.fd),)


def _inherit(duplicate) -> int:
    return duplicate.detach()


def _main(argv: list[str], cwd: str, env: dict[str, str], path: list[str], outputs: tuple,
          new_session: bool = False) -> None:
    """In the forked process: become `python -m dptrain ARGV` and exit as the interpreter would. `outputs`:
    stdout's and stderr's file names, or descriptors (pipes) inherited from the caller."""
    import atexit
    import runpy
    import threading
    import traceback

    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    inherited = set()
    for fd, target in zip((1, 2), outputs):
        if isinstance(target, int):
            os.dup2(target, fd)
            inherited.add(target)
        else:
            opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
    for fd in inherited - {1, 2}:
        os.close(fd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered, "strict")
    sys.stderr = sys.__stderr__ = _stream(2, True, "backslashreplace")
    sys.path[:] = path
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.argv[:] = ["-m", *argv]
    code: object = 0
    try:
        runpy.run_module("dptrain", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # the interpreter waits for non-daemon threads, then runs atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)


def _prepared(args: Sequence[str], cwd, env: dict[str, str]) -> tuple[list[str], str, list[str]]:
    """What the forked process is given: its arguments, its directory (absolute) and its sys.path."""
    cwd = os.path.abspath(cwd)
    extra = [os.path.join(cwd, entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return [str(arg) for arg in args], cwd, [cwd, *extra, *_interpreter_path()]


def _text(path: Path) -> str:
    """A file's bytes as subprocess.run(text=True) gives them: locale encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding=locale.getpreferredencoding(False)).read()


def run_dptrain(args: Sequence[str], *, cwd, env: Optional[dict[str, str]] = None,
                timeout: float = 240) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, "-m", "dptrain", *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout), forked from the test fork server (see the module's docstring)."""
    command = [sys.executable, "-m", "dptrain", *map(str, args)]
    env = dict(os.environ if env is None else env)
    if not forkable(env):
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    argv, cwd, path = _prepared(args, cwd, env)
    with tempfile.TemporaryDirectory(prefix="dptrain-cli-") as tmp:
        outputs = (os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr"))
        proc = fork_server().Process(target=_main, args=(argv, cwd, env, path, outputs))
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join(10)
        stdout, stderr = (_text(Path(name)) if os.path.exists(name) else "" for name in outputs)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, proc.exitcode, stdout, stderr)


class ForkedDptrain:
    """subprocess.Popen([sys.executable, "-m", "dptrain", *args], cwd=cwd, env=env, stdout=PIPE,
    stderr=PIPE (or STDOUT with `merge_stderr`), text=True, start_new_session=new_session), forked from the
    test fork server as run_dptrain's commands are: the methods and attributes the tests use (pid, stdout,
    stderr, poll, wait, communicate, send_signal, terminate, kill, returncode)."""

    def __init__(self, args: Sequence[str], *, cwd, env: Optional[dict[str, str]] = None, merge_stderr: bool = False,
                 new_session: bool = False) -> None:
        self.args = [sys.executable, "-m", "dptrain", *map(str, args)]
        env = dict(os.environ if env is None else env)
        assert forkable(env), "an environment that changes how torch starts: use subprocess.Popen"
        argv, cwd, path = _prepared(args, cwd, env)
        out_r, out_w = os.pipe()
        err_r, err_w = (out_r, out_w) if merge_stderr else os.pipe()
        try:
            self._proc = fork_server().Process(target=_main, args=(
                argv, cwd, env, path, (_Inherited(out_w), _Inherited(err_w)), new_session))
            self._proc.start()
        finally:
            os.close(out_w)
            if not merge_stderr:
                os.close(err_w)
        self.pid = self._proc.pid
        self.stdout = _reader(out_r)
        self.stderr = None if merge_stderr else _reader(err_r)
        self.returncode: Optional[int] = None
        self._read: dict[str, list] = {}

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, Optional[str]]:
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._read:
                chunks: list = []
                thread = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()), daemon=True)
                thread.start()
                self._read[name] = [thread, chunks]
        for thread, _ in self._read.values():
            thread.join(timeout)
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        out = "".join(self._read["stdout"][1])
        return out, ("".join(self._read["stderr"][1]) if "stderr" in self._read else None)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _reader(fd: int) -> io.TextIOWrapper:
    """A pipe's read end as Popen(text=True) gives it: locale encoding, universal newlines."""
    return io.TextIOWrapper(io.open(fd, "rb"), encoding=locale.getpreferredencoding(False))
