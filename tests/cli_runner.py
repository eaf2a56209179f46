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
import subprocess
import sys
import tempfile
from functools import lru_cache
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


def _main(argv: list[str], cwd: str, env: dict[str, str], path: list[str], outputs: tuple[str, str]) -> None:
    """In the forked process: become `python -m dptrain ARGV` and exit as the interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in zip((1, 2), outputs):
        opened = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
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
    cwd = os.path.abspath(cwd)
    extra = [os.path.join(cwd, entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = [cwd, *extra, *_interpreter_path()]
    with tempfile.TemporaryDirectory(prefix="dptrain-cli-") as tmp:
        outputs = (os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr"))
        proc = fork_server().Process(target=_main, args=([str(arg) for arg in args], cwd, env, path, outputs))
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
