"""The local launcher: spawn N worker processes on this machine, as torchrun would, but quieter.

Each worker gets the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) plus DPTRAIN_LAUNCHER=local, its share of the CPU threads, and its output
prefixed with its rank. If any worker fails, the others are stopped and the launcher exits
non-zero with one line naming the failed rank.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from typing import IO, Optional, Sequence

from dptrain.errors import Preempted
from dptrain.runtime.env import free_port

PREEMPTED = Preempted.exit_code



def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes]) -> None:
    """Copy a worker's output to ours, prefixing every line (and every progress-bar redraw).

    Only whole lines (ending in \n or \r) are written, each batch in one write, so lines of
    different ranks never interleave mid-line; a partial line waits for its end.
    """
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
            sink.write(_prefixed(pending[:cut], prefix))
            sink.flush()
            pending = pending[cut:]
    if pending:
        sink.write(_prefixed(pending, prefix))
        sink.flush()


def _prefixed(data: bytes, prefix: bytes) -> bytes:
    """`prefix` before every line of `data` (which starts at a line start)."""
    lines = re.split(rb"(?<=[\r\n])", data)
    return b"".join(prefix + line for line in lines if line)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def worker_env(rank: int, world: int, port: int, threads: int, base: dict[str, str], *,
               master_addr: str = "127.0.0.1", tty: Optional[bool] = None) -> dict[str, str]:
    """A local worker's environment: torchrun's variables on top of `base`. `tty` (default: whether
    our stderr is a terminal) lets rank 0 draw a progress bar although its output is piped."""
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=master_addr, MASTER_PORT=str(port), DPTRAIN_LAUNCHER="local",
        OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
    )
    if sys.stderr.isatty() if tty is None else tty:
        env["DPTRAIN_TTY"] = "1"
    else:
        env.pop("DPTRAIN_TTY", None)
    return env


def launch_local(workers: int, argv: Sequence[str]) -> int:
    """Run `python -m dptrain ARGV` as `workers` ranks; return 0 or the first failure's code."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(workers):
        proc = subprocess.Popen(
            [sys.executable, "-m", "dptrain", *argv],
            env=worker_env(rank, workers, port, threads, dict(os.environ)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )
        procs.append(proc)
        prefix = f"[rank{rank}] ".encode()
        for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            pump = threading.Thread(target=_pump, args=(stream, prefix, sink), daemon=True)
            pump.start()
            pumps.append(pump)

    # One waiter thread per worker reports exits in the order they happen, so the worker
    # that failed first is named, not a peer that failed because it lost that worker.
    exits: queue.Queue = queue.Queue()
    for rank, proc in enumerate(procs):
        threading.Thread(target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True).start()
    # A scheduler's warning (SIGTERM/SIGUSR1) is passed on: the workers checkpoint and stop.
    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    failed: tuple[int, int] | None = None
    preempted = False
    try:
        for _ in procs:
            rank, code = exits.get()
            if code == PREEMPTED:
                preempted = True
            elif code != 0:
                failed = (rank, code)
                break
    except KeyboardInterrupt:
        failed = (-1, 130)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    if failed is not None:
        rank, code = failed
        if rank >= 0:
            print(f"dptrain: worker rank {rank} {describe_exit(code)}; stopping the other workers", file=sys.stderr, flush=True)
        _stop(procs)
    for pump in pumps:
        pump.join(timeout=5)
    if failed is None:
        return PREEMPTED if preempted else 0
    code = failed[1]
    return code if 0 < code < 256 else 1


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill the survivors: a world that lost a worker can neither finish nor checkpoint consistently
    (the last complete checkpoint stays the one to resume from)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
