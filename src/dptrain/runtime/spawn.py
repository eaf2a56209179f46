"""The one process spawner: start the N ranks of a job on this machine and wait for them (train, run, bench).

Each rank gets the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) plus DPTRAIN_LAUNCHER (`local` for `dptrain train`'s workers, `dptrain-run` for
the ranks of a user's script) and its share of the CPU threads. Its output is
either pumped to ours with a `[rankN] ` prefix or written to `rankN.log` in a directory. A
scheduler's warning (SIGTERM, SIGUSR1) is passed on to every rank; the first rank to fail is
reported and the others are stopped.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable, Optional, Sequence

from dptrain.errors import Preempted

PREEMPTED = Preempted.exit_code
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class RanksExit:
    """How the ranks ended: all well, stopped on request, a rank failed first, or out of time."""

    seconds: float  # from the first start to the last exit (or to the failure)
    failed_rank: Optional[int] = None  # the first rank that failed
    failed_code: int = 0  # its exit code (negative: killed by that signal)
    preempted: bool = False  # a rank checkpointed and stopped on request (exit code 75)
    timed_out: bool = False
    # Ranks still running `linger` seconds after the first rank finished (frozen, or stuck): the
    # last wait on each other was over when one could finish, so the rest had only local work left.
    stuck_ranks: tuple[int, ...] = ()
    first_done: Optional[int] = None  # the rank that finished first
    stop_signal: Optional[int] = None  # a stop signal (SIGTERM, SIGUSR1) we received and passed on to the ranks

    @property
    def code(self) -> int:
        """One exit code for the whole job: 0, 75 (preempted), or the failed rank's code (1 if not a code)."""
        if self.failed_rank is not None:
            return self.failed_code if 0 < self.failed_code < 256 else 1
        if self.timed_out or self.stuck_ranks:
            return 1
        return PREEMPTED if self.preempted else 0


def worker_env(rank: int, world: int, port: int, threads: int, base: dict[str, str], *,
               master_addr: str = "127.0.0.1", tty: Optional[bool] = None, launcher: str = "local") -> dict[str, str]:
    """A local worker's environment: torchrun's variables on top of `base`. `tty` (default: whether
    our stderr is a terminal) lets rank 0 draw a progress bar although its output is piped;
    `launcher` is DPTRAIN_LAUNCHER, which tells the rank who started it (dptrain.runtime.env)."""
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=master_addr, MASTER_PORT=str(port), DPTRAIN_LAUNCHER=launcher,
        OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
    )
    if sys.stderr.isatty() if tty is None else tty:
        env["DPTRAIN_TTY"] = "1"
    else:
        env.pop("DPTRAIN_TTY", None)
    return env


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def spawn_ranks(command: Sequence[str], world: int, *, port: int, master_addr: str = "127.0.0.1",
                threads: Optional[int] = None, extra_env: Optional[dict[str, str]] = None,
                prefix: Optional[Callable[[int], list[str]]] = None, log_dir: Optional[Path] = None,
                timeout: Optional[float] = None, linger: Optional[float] = None,
                launcher: str = "local") -> RanksExit:
    """Run `command` as ranks 0..world-1 and wait until all have exited, one has failed, `timeout` passed,
    or (with `linger`) some ranks are still running that long after the first one ended well.

    `prefix(rank)` is put before the command (e.g. `ip netns exec HOST`). Output goes to
    `log_dir/rankN.log` when a directory is given, else to our stdout/stderr prefixed with the
    rank. `threads` is each rank's OMP_NUM_THREADS (default: the cores divided by the ranks).
    On failure, time-out or Ctrl-C the surviving ranks are killed: a world that lost a rank can
    neither finish nor checkpoint consistently (the last complete checkpoint stays the one to
    resume from). `launcher` is the ranks' DPTRAIN_LAUNCHER.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    base = {**os.environ, **(extra_env or {})}
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    logs: list[IO[bytes]] = []
    begun = time.perf_counter()
    # One waiter thread per rank reports exits in the order they happen, so the rank that
    # failed first is named, not a peer that failed because it lost that rank.
    exits: queue.Queue = queue.Queue()
    previous: dict[int, object] = {}
    forwarded: list[int] = []
    # Set on Ctrl-C: what the ranks still print as they die (KeyboardInterrupt tracebacks) is not echoed.
    interrupted = threading.Event()
    try:
        for rank in range(world):
            env = worker_env(rank, world, port, threads, base, master_addr=master_addr,
                             tty=False if log_dir is not None else None, launcher=launcher)
            argv = [*(prefix(rank) if prefix else []), *command]
            if log_dir is not None:
                logs.append(open(log_dir / f"rank{rank}.log", "wb"))
                proc = subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            else:
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL)
                label = f"[rank{rank}] ".encode()
                for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                    pumps.append(threading.Thread(target=_pump, args=(stream, label, sink, interrupted),
                                                  daemon=True))
                    pumps[-1].start()
            procs.append(proc)
            threading.Thread(target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True).start()
        previous = _forward_signals(procs, forwarded)
        ended = _wait(exits, world, begun, timeout, linger)
        return replace(ended, stop_signal=forwarded[0]) if forwarded else ended
    except KeyboardInterrupt:
        interrupted.set()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(procs)
        for pump in pumps:
            pump.join(timeout=5)
        for log in logs:
            log.close()


def _wait(exits: queue.Queue, world: int, begun: float, timeout: Optional[float],
          linger: Optional[float] = None) -> RanksExit:
    """Collect the ranks' exits until all are in, the first failure, the deadline, or the linger limit."""
    deadline = None if timeout is None else begun + timeout
    preempted, done, first_done_at, first_finished = False, [], None, None
    for _ in range(world):
        limits = [] if deadline is None else [deadline]
        if linger is not None and first_done_at is not None:
            limits.append(first_done_at + linger)
        try:
            remaining = max(min(limits) - time.perf_counter(), 0) if limits else None
            rank, code = exits.get(timeout=remaining)
        except queue.Empty:
            if deadline is not None and time.perf_counter() >= deadline:
                return RanksExit(time.perf_counter() - begun, preempted=preempted, timed_out=True)
            stuck = tuple(r for r in range(world) if r not in done)
            return RanksExit(time.perf_counter() - begun, preempted=preempted, stuck_ranks=stuck,
                             first_done=first_finished)
        done.append(rank)
        if code == 0 and first_done_at is None:  # finished: after a stop (75) an async peer may still be in its epoch
            first_done_at, first_finished = time.perf_counter(), rank
        if code == PREEMPTED:
            preempted = True
        elif code != 0:
            return RanksExit(time.perf_counter() - begun, failed_rank=rank, failed_code=code, preempted=preempted)
    return RanksExit(time.perf_counter() - begun, preempted=preempted)


def _forward_signals(procs: list[subprocess.Popen], forwarded: list[int]) -> dict[int, object]:
    """Pass a scheduler's warning on to the ranks (they checkpoint and stop), noting it in `forwarded`;
    returns the previous handlers.

    Only the main thread may install handlers; elsewhere the warning reaches whoever handles it there.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        forwarded.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    return {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes], silenced: Optional[threading.Event] = None) -> None:
    """Copy a worker's output to ours, prefixing every line (and every progress-bar redraw).

    Only whole lines (ending in \n or \r) are written, each batch in one write, so lines of
    different ranks never interleave mid-line; a partial line waits for its end. Once `silenced`
    is set, the rest is read and dropped.
    """
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        pending += chunk
        if silenced is not None and silenced.is_set():
            pending = b""
            continue
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
            sink.write(_prefixed(pending[:cut], prefix))
            sink.flush()
            pending = pending[cut:]
    if pending and not (silenced is not None and silenced.is_set()):
        sink.write(_prefixed(pending, prefix))
        sink.flush()


def _prefixed(data: bytes, prefix: bytes) -> bytes:
    """`prefix` before every line of `data` (which starts at a line start)."""
    lines = re.split(rb"(?<=[\r\n])", data)
    return b"".join(prefix + line for line in lines if line)
