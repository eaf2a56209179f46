"""The one process spawner: start the N ranks of a job on this machine and wait for them (train, run, bench).

Each rank gets the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) plus DPTRAIN_LAUNCHER (`local` for `dptrain train`'s workers, `dptrain-run` for
the ranks of a user's script) and its share of the CPU threads. Its output is
either pumped to ours with a `[rankN] ` prefix or written to `rankN.log` in a directory. A
scheduler's warning (SIGTERM, SIGUSR1, SIGUSR2) is passed on to every rank (with a grace, those still
running that long after it are killed); the first rank to fail is reported and the others are stopped.
`spawn_ranks` starts and waits; `start_ranks` only starts,
optionally holding the ranks until they are given one line on stdin (dptrain.runtime.prestart).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable, Optional, Sequence

from dptrain.errors import Preempted
from dptrain.runtime.sessions import LAUNCHER_PID
from dptrain.runtime.store_keys import EXITED, WORLD, admitted

PREEMPTED = Preempted.exit_code
# A scheduler's warnings (SLURM --signal, PBS and Kubernetes TERM before the kill; USR2 where a site uses it).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
STOP_LOOK = 0.5  # seconds between looks for a stop signal while a grace after it is to be kept
LEFT_BEHIND = 5.0  # seconds after the main rank ended well that a rank the others went on without may still take
# Rank 0 finds here the number of an inherited socket already listening on MASTER_PORT, to serve the store on.
STORE_FD = "DPTRAIN_STORE_FD"
# Set for every rank when the launcher serves the store itself (--min-workers): rank 0 joins it as the others
# do, so that losing rank 0 does not take the store with it.
STORE_SERVED = "DPTRAIN_STORE_SERVED"
PRESTARTED = "DPTRAIN_PRESTARTED"  # set in a pre-started worker's environment until it is released (prestart)
JOIN = "DPTRAIN_JOIN"  # a worker joining a running job: its rank of the job, or "new" to take one from the store
# The prefixes of the default group's keys in the store: what init_process_group's store adds ("default_pg"), then
# torch's for the group named "0" (the first group a process makes). Joiners and the launcher see the ranks' keys so.
STORE_PREFIXES = ("default_pg", "0/")


def job_store(store):
    """`store` (a TCPStore of the job's) as the ranks' default group sees it: dptrain's keys (membership,
    heartbeats) are the same for a joiner and the launcher as for the ranks."""
    import torch.distributed as dist

    for prefix in STORE_PREFIXES:
        store = dist.PrefixStore(prefix, store)
    return store


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
    lost: tuple[int, ...] = ()  # ranks that failed while the others went on without them (--min-workers)
    left_running: tuple[int, ...] = ()  # of those, ranks still running (frozen) when the others were done
    stop_signal: Optional[int] = None  # a stop signal (SIGTERM, SIGUSR1, SIGUSR2) we received and passed on to the ranks
    # Ranks still running `grace` seconds after that signal, killed then (the others had saved and exited).
    unstopped: tuple[int, ...] = ()

    @property
    def code(self) -> int:
        """One exit code for the whole job: 0, 75 (preempted), or the failed rank's code (1 if not a code)."""
        if self.failed_rank is not None:
            return self.failed_code if 0 < self.failed_code < 256 else 1
        if self.timed_out or self.stuck_ranks:
            return 1
        if self.unstopped and not self.preempted:  # none of them saved its state to be resumed
            return 1
        return PREEMPTED if self.preempted else 0


def worker_env(rank: int, world: int, port: int, threads: int, base: dict[str, str], *,
               master_addr: str = "127.0.0.1", tty: Optional[bool] = None, launcher: str = "local",
               local_rank: Optional[int] = None, local_world: Optional[int] = None) -> dict[str, str]:
    """A local worker's environment: torchrun's variables on top of `base`. `tty` (default: whether
    our stderr is a terminal) lets rank 0 draw a progress bar although its output is piped;
    `launcher` is DPTRAIN_LAUNCHER, which tells the rank who started it (dptrain.runtime.env);
    `local_rank` (default: `rank`) is its slot on this machine, its GPU under NCCL; `local_world` (default:
    `world`) the ranks on this machine (several machines: dptrain.runtime.nodes)."""
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank if local_rank is None else local_rank),
        LOCAL_WORLD_SIZE=str(world if local_world is None else local_world),
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
                listener: Optional[socket.socket] = None, launcher: str = "local", may_lose: int = 0,
                grace: Optional[float] = None, serve_store: bool = False) -> RanksExit:
    """Run `command` as ranks 0..world-1 and wait until all have exited, one has failed, `timeout` passed,
    (with `linger`) some ranks are still running that long after the first one ended well, or (with
    `grace`) some are still running that long after a stop signal was passed on to them.

    `prefix(rank)` is put before the command (e.g. `ip netns exec HOST`). Output goes to
    `log_dir/rankN.log` when a directory is given, else to our stdout/stderr prefixed with the
    rank. `threads` is each rank's OMP_NUM_THREADS (default: the cores divided by the ranks).
    On failure, time-out or Ctrl-C the surviving ranks are killed: a world that lost a rank can
    neither finish nor checkpoint consistently (the last complete checkpoint stays the one to
    resume from). `launcher` is the ranks' DPTRAIN_LAUNCHER.
    """
    ranks = start_ranks(command, world, port=port, master_addr=master_addr, threads=threads, extra_env=extra_env,
                        prefix=prefix, log_dir=log_dir, listener=listener, launcher=launcher, serve_store=serve_store)
    try:
        if serve_store:
            ranks.serve_store(timeout or 300.0)
        return ranks.wait(timeout=timeout, linger=linger, may_lose=may_lose, grace=grace)
    finally:
        ranks.close()


def start_ranks(command: Sequence[str], world: int, *, port: int, master_addr: str = "127.0.0.1",
                threads: Optional[int] = None, extra_env: Optional[dict[str, str]] = None,
                prefix: Optional[Callable[[int], list[str]]] = None, log_dir: Optional[Path] = None,
                held: bool = False, listener: Optional[socket.socket] = None, launcher: str = "local",
                serve_store: bool = False, first_rank: int = 0, job_world: Optional[int] = None,
                sessions: bool = False) -> "Ranks":
    """Start `command` as ranks 0..world-1 (see spawn_ranks) and return them running; `Ranks.wait` waits.
    With `first_rank` and `job_world` (one machine of several, dptrain.runtime.nodes), they are ranks
    first_rank..first_rank+world-1 of a job of `job_world`, local ranks 0..world-1 here (`Ranks` and its exits
    count them from 0; their output is labelled with their rank of the job).

    With `held`, each rank's stdin is a pipe and the ranks are meant to wait for one line on it
    (`Ranks.release`), so they can start (import torch) while this process still prepares the run;
    closing the ranks unreleased kills them. Held ranks start with SIGINT, SIGTERM, SIGUSR1 and SIGUSR2
    blocked, to be unblocked by the rank once it handles them (dptrain.runtime.prestart): a Ctrl-C
    is ours to report until they are released, and a scheduler's stop signal that comes while the
    interpreter starts is kept for the rank to honour, not fatal.

    `listener` (see `store_listener`) is handed to rank 0, which serves the store on it, and
    closed here: the port is never free between its choice and the store. With `serve_store` it is
    kept instead, for this process to serve the store on (`Ranks.serve_store`) and every rank to join.

    With `sessions` (`dptrain train`'s workers, whose `python -m dptrain` calls `die_with_launcher`) each rank
    runs in a session of its own, as torchrun starts its workers (why: dptrain.runtime.sessions). A terminal's
    Ctrl-C then reaches this process alone, which stops the ranks (`close`); the ranks end with this process
    (their parent-death signal).
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    from dptrain.runtime import signed

    # the run's secret (dptrain.runtime.signed): the ranks, and a joiner started later, inherit it
    base = {**os.environ, signed.SECRET_ENV: signed.ensure_secret(), **(extra_env or {})}
    if sessions:
        base[LAUNCHER_PID] = str(os.getpid())
    ranks = Ranks(world, sessions)
    # Children inherit the signal mask (through exec); ours is restored below, delivering a Ctrl-C
    # that came meanwhile. Threads started meanwhile (output pumps, waiters) keep it blocked: Python
    # runs signal handlers on the main thread anyway.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *FORWARDED_SIGNALS}) if held else None
    if not held:  # ranks that run at once are theirs to stop from the first one on: no moment leaves one behind
        ranks.pass_on_stop_signals()
    try:
        for rank in range(world):
            env = worker_env(first_rank + rank, job_world or world, port, threads, base, master_addr=master_addr,
                             tty=False if log_dir is not None else None, launcher=launcher, local_rank=rank,
                             local_world=world)
            handed: tuple[int, ...] = ()
            if serve_store:
                env[STORE_SERVED] = "1"
            elif listener is not None and rank == 0:
                handed = (listener.fileno(),)
                env[STORE_FD] = str(listener.fileno())
            ranks.start(rank, [*(prefix(rank) if prefix else []), *command], env, held=held, handed=handed,
                        log_dir=log_dir, shown=first_rank + rank)
    except BaseException:
        ranks.close()
        raise
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if listener is not None and serve_store:
            ranks.listener = listener
            ranks.spawned = (world, port, threads, base, master_addr, launcher, log_dir)
        elif listener is not None:
            listener.close()  # rank 0 holds it now (or, if it did not start, nobody needs it)
    return ranks


def store_listener(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a port the OS picks on `host`, for rank 0's store (`start_ranks(listener=...)`).

    A rank that comes to the rendezvous before rank 0 serves the store finds the port listening:
    its connection waits in the backlog instead of being refused (torch retries a refused
    connection only after a back-off of about half a second).
    """
    return socket.create_server((host, 0))


class Ranks:
    """Rank processes that were started: release them (if held), wait for them, close (kill what is left)."""

    def __init__(self, world: int, sessions: bool = False) -> None:
        self.world, self.sessions = world, sessions  # sessions: each rank in a session of its own (start_ranks)
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.logs: list[IO[bytes]] = []
        # One waiter thread per rank reports exits in the order they happen, so the rank that
        # failed first is named, not a peer that failed because it lost that rank.
        self.exits: queue.Queue = queue.Queue()
        self.begun = time.perf_counter()
        self.closed = False
        # Set on Ctrl-C: what the ranks still print as they die (KeyboardInterrupt tracebacks) is not echoed.
        self.interrupted = threading.Event()
        self.said = SaidOnce()  # an error line several ranks print alike is shown once
        self.listener: Optional[socket.socket] = None  # where this process is to serve the ranks' store
        self.store = None  # the store this process serves (serve_store), kept while the ranks run
        self.slots: dict[int, int] = {}  # a joiner's rank -> the local slot (GPU) of the rank it replaced
        self.spawned: Optional[tuple] = None  # how the ranks were started, to start a joiner the same way
        self.forwarded: list[tuple[int, float]] = []  # (signal, when) of each stop signal passed on to the ranks
        self.handlers: Optional[dict[int, object]] = None  # the handlers before pass_on_stop_signals, to restore

    def pass_on_stop_signals(self) -> None:
        """From now until `close`, a stop signal this process receives is passed on to the ranks (they
        checkpoint and stop) and noted in `forwarded`; before a launcher releases its ranks, so that no moment
        between its own handling and theirs is left uncovered."""
        if self.handlers is None:
            self.handlers = _forward_signals(self.procs, self.forwarded)

    def start(self, rank: int, argv: Sequence[str], env: dict[str, str], *, held: bool = False,
              handed: tuple[int, ...] = (), log_dir: Optional[Path] = None,
              shown: Optional[int] = None) -> subprocess.Popen:
        """Start rank `rank` as `argv` with `env`: its output to `log_dir/rankN.log` or prefixed to ours (N:
        `shown`, its rank of the job, by default `rank`); its exit reported to `wait`."""
        stdin = subprocess.PIPE if held else subprocess.DEVNULL
        shown = rank if shown is None else shown
        if log_dir is not None:
            self.logs.append(open(log_dir / f"rank{shown}.log", "wb"))
            proc = subprocess.Popen(argv, env=env, stdout=self.logs[-1], stderr=subprocess.STDOUT, stdin=stdin,
                                    pass_fds=handed, start_new_session=self.sessions)
        else:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin,
                                    pass_fds=handed, start_new_session=self.sessions)
            label = f"[rank{shown}] ".encode()
            for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                self.pumps.append(threading.Thread(target=_pump, args=(stream, label, sink, self.interrupted,
                                                                       self.said), daemon=True))
                self.pumps[-1].start()
        self.procs.append(proc)
        if self.forwarded and not held:  # a stop signal came while the ranks were being started: this one's too
            proc.send_signal(self.forwarded[0][0])
        threading.Thread(target=lambda: self.exits.put((rank, proc.wait())), daemon=True).start()
        return proc

    def start_joiners(self, argv: Sequence[str], replacing: int, count: int) -> Optional[tuple[int, ...]]:
        """`count` new workers in place of lost rank `replacing` (--replace-workers): one (`start_joiner`), or, for a
        sharded run (--shard hybrid), a whole replica group of `count` ranks in place of the lost rank's group (its
        other ranks leave), which joins at an epoch end as a new group, each rank healed from its peer in a live
        group. Their ranks, or None where this process serves no store (nothing to join)."""
        if count == 1:
            joiner = self.start_joiner(argv, replacing)
            return None if joiner is None else (joiner,)
        # the lost group's local slots (GPUs): joiners take ranks of the job in groups of `count`, after the first ones
        first = replacing - (replacing % count if replacing < self.world else (replacing - self.world) % count)
        joiners = tuple(self.start_joiner(argv, first + place, said=False) for place in range(count))
        if None in joiners:
            return None
        print(f"dptrain: starting worker ranks {', '.join(map(str, joiners))} as a new replica group in place of "
              f"rank {replacing}'s; they join the others at the next epoch end after all are ready, each healed from "
              "its peer in a live group", file=sys.stderr, flush=True)
        return joiners

    def start_joiner(self, argv: Sequence[str], replacing: int, said: bool = True) -> Optional[int]:
        """A new worker in place of lost rank `replacing` (--replace-workers): `python -m dptrain ARGV` as the
        next rank of the job, joining the running ranks at their next epoch end (dptrain.runtime.membership).
        Its rank, or None where this process serves no store (nothing to join)."""
        if self.store is None or self.spawned is None:
            return None
        from dptrain.runtime.membership import take_rank

        world, port, threads, base, master_addr, launcher, log_dir = self.spawned
        rank = take_rank(self.job_store())
        # The lost rank's slot, which its GPU is free on: the joiner's own rank would be past the GPUs there are.
        self.slots[rank] = self.slots.get(replacing, replacing)
        env = worker_env(rank, world, port, threads, base, master_addr=master_addr,
                         tty=False if log_dir is not None else None, launcher=launcher, local_rank=self.slots[rank])
        env.update({STORE_SERVED: "1", JOIN: str(rank)})
        env.pop(PRESTARTED, None)
        self.start(rank, [sys.executable, "-m", "dptrain", *argv], env, log_dir=log_dir)
        if said:
            print(f"dptrain: starting worker rank {rank} in place of rank {replacing}; it joins the others at the "
                  "next epoch end after it is ready", file=sys.stderr, flush=True)
        return rank

    @property
    def address(self) -> Optional[tuple[str, int]]:
        """Where the store this process serves listens (start_ranks(serve_store=True)): `dptrain join` connects."""
        return None if self.spawned is None else (self.spawned[4], self.spawned[1])

    def admitted(self, rank: int) -> bool:
        """Whether the ranks admitted joiner `rank` (dptrain.runtime.membership), as the store this process serves says."""
        if self.store is None:
            return False
        try:
            from dptrain.runtime import signed

            return signed.present(self.job_store(), admitted(rank))
        except Exception:  # noqa: BLE001 - it is this process's own store: it answers while this process runs
            return False

    def exited(self, rank: int) -> None:
        """Tell the ranks, through the store this process serves, that rank `rank`'s process ended: the survivors
        agreeing on who is left need not wait for its heartbeat to go quiet (dptrain.runtime.membership)."""
        try:
            from dptrain.runtime import signed

            signed.put(self.job_store(), f"{EXITED}{rank}", "1")
        except Exception:  # noqa: BLE001 - its own store; the survivors find the rank quiet anyway
            pass

    def job_store(self):
        """The store this process serves, as the ranks see it (`job_store`)."""
        return job_store(self.store)

    def serve_store(self, timeout: float) -> None:
        """Serve the ranks' rendezvous store from this process (start_ranks(serve_store=True)), so that it
        outlives any one rank: rank 0 may be lost then too (--min-workers)."""
        import datetime

        import torch.distributed as dist  # only a launcher that serves the store imports it

        listener, self.listener = self.listener, None
        if listener is None:
            return
        host, port = listener.getsockname()[:2]
        self.store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False, master_listen_fd=listener.detach())
        from dptrain.runtime import signed

        signed.put(self.job_store(), WORLD, str(self.world))  # joiners take the ranks after the job's first ones

    def release(self, message: bytes) -> None:
        """Give held ranks their one line (`message`, without its newline) and close their stdin.

        A rank that already died is not written to: `wait` reports its exit as a failure.
        """
        self.begun = time.perf_counter()  # the time limits count from here, when the ranks have their work
        for proc in self.procs:
            if proc.stdin is None:
                continue
            try:
                proc.stdin.write(message + b"\n")
                proc.stdin.close()
            except OSError:  # it died before its release (BrokenPipeError)
                pass

    def wait(self, timeout: Optional[float] = None, linger: Optional[float] = None, may_lose: int = 0,
             grace: Optional[float] = None,
             replacement: Optional[Callable[[int], Optional[tuple[int, ...]]]] = None) -> RanksExit:
        """Until all have exited, one has failed, `timeout` passed, one has lingered, or the `grace` after a
        stop signal is over (see spawn_ranks). Up to `may_lose` ranks may fail first without ending the wait
        (the others go on without them), rank 0 only when this process serves the store: each is counted in
        `lost`, and said in one line unless it left on request (75). `replacement(rank)` may start workers in place
        of a failed one (their ranks, or None): they are waited for too, and give the lost places back."""
        self.pass_on_stop_signals()
        forwarded = self.forwarded
        try:
            ended = _wait(self.exits, self.world, self.begun, timeout, linger, may_lose,
                          stopped=forwarded if grace is not None else None, grace=grace,
                          keeper=None if self.store is not None else 0, replacement=replacement,
                          admitted=self.admitted, exited=self.exited if self.store is not None else None)
            return replace(ended, stop_signal=forwarded[0][0]) if forwarded else ended
        except KeyboardInterrupt:
            self.interrupted.set()
            raise

    def close(self) -> None:
        """Kill the ranks still running, then collect their output threads and logs (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        _stop(self.procs)
        # Only now: a stop signal while the ranks were being killed was theirs, not one to end this process midway.
        for signum, handler in (self.handlers or {}).items():
            signal.signal(signum, handler)
        self.handlers = None
        if self.listener is not None:
            self.listener.close()
        self.store = None
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for pump in self.pumps:
            pump.join(timeout=5)
        for log in self.logs:
            log.close()


def _wait(exits: queue.Queue, world: int, begun: float, timeout: Optional[float],
          linger: Optional[float] = None, may_lose: int = 0, *, stopped: Optional[list[tuple[int, float]]] = None,
          grace: Optional[float] = None, keeper: Optional[int] = 0,
          replacement: Optional[Callable[[int], Optional[tuple[int, ...]]]] = None,
          admitted: Callable[[int], bool] = lambda rank: False,
          exited: Optional[Callable[[int], None]] = None) -> RanksExit:
    """Collect the ranks' exits until all are in, the first failure, the deadline, the linger limit, or
    `grace` seconds after the first stop signal noted in `stopped` (filled in as signals come). With
    `may_lose`, ranks other than `keeper` (the store's host; None: the store outlives every rank) may be lost;
    `replacement(rank)` may start a rank in place of a failed one (see Ranks.wait); `admitted(rank)`: whether such a
    replacement trains with the others yet; `exited(rank)` is told of each rank lost (the survivors need not wait
    for its silence)."""
    deadline = None if timeout is None else begun + timeout
    preempted, done, first_done_at, first_finished, lost = False, [], None, None, []
    started = list(range(world))  # the ranks to wait for: the job's first ones, then replacements
    joiners: list[int] = []  # the replacements; each is a member once the others admitted it

    def members_left(without: int) -> int:
        """The members besides rank `without` not lost (a replacement only once the others admitted it)."""
        return sum(1 for r in started if r not in lost and r != without and (r not in joiners or admitted(r)))
    while len(done) < len(started):
        # Once the main rank (the lowest not lost: it writes the results) ended well, ranks the others went on
        # without (frozen) have nothing left to do.
        main = min((r for r in started if r not in lost), default=0)
        left_behind = may_lose and main in done and first_done_at is not None
        lingered = None
        if linger is not None and first_done_at is not None:
            lingered = first_done_at + (min(linger, LEFT_BEHIND) if left_behind else linger)
        graced = stopped[0][1] + grace if stopped and grace is not None else None
        # Until a stop signal has come, look again now and then: its grace starts when it comes.
        look = time.perf_counter() + STOP_LOOK if stopped is not None and graced is None else None
        limits = [limit for limit in (deadline, lingered, graced, look) if limit is not None]
        try:
            remaining = max(min(limits) - time.perf_counter(), 0) if limits else None
            rank, code = exits.get(timeout=remaining)
        except queue.Empty:
            now = time.perf_counter()
            if graced is not None and now >= graced:
                return RanksExit(now - begun, preempted=preempted, lost=tuple(lost),
                                 unstopped=tuple(r for r in started if r not in done))
            if deadline is not None and now >= deadline:
                return RanksExit(now - begun, preempted=preempted, timed_out=True)
            if lingered is None or now < lingered:
                continue
            stuck = tuple(r for r in started if r not in done)
            if left_behind and len(lost) + len(stuck) <= may_lose + len(joiners):
                for rank in stuck:
                    print(f"dptrain: worker rank {rank} was still running after the others finished without it "
                          "(frozen); stopping it", file=sys.stderr, flush=True)
                return RanksExit(now - begun, preempted=preempted, lost=tuple(lost) + stuck, left_running=stuck)
            return RanksExit(now - begun, preempted=preempted, stuck_ranks=stuck, first_done=first_finished)
        done.append(rank)
        if code == 0 and first_done_at is None:  # finished: after a stop (75) an async peer may still be in its epoch
            first_done_at, first_finished = time.perf_counter(), rank
        running = [r for r in started if r not in done]
        if code == 0 and running and all(r in joiners and not admitted(r) for r in running):
            # the run is over: replacements still starting or waiting for a place have nothing to join (closed)
            return RanksExit(time.perf_counter() - begun, preempted=preempted, lost=tuple(lost))
        # A lost rank leaves the others going on while at least (the first world - may_lose) members are left.
        if code == PREEMPTED and rank != keeper and may_lose and not stopped and members_left(rank) >= world - may_lose:
            lost.append(rank)  # asked to stop alone, it left and the others go on (it said so itself); when the
            # whole job stops (a stop signal passed on to all), rank 0 stops too: its 75 makes the job's
        elif code == PREEMPTED:
            preempted = True
        elif code != 0 and rank != keeper and may_lose and members_left(rank) >= world - may_lose:
            lost.append(rank)
            if exited is not None:
                exited(rank)
            print(f"dptrain: worker rank {rank} {describe_exit(code)}; the others go on without it",
                  file=sys.stderr, flush=True)
            new = replacement(rank) if replacement is not None and first_done_at is None else None
            started.extend(new or ())
            joiners.extend(new or ())
        elif code != 0:
            return RanksExit(time.perf_counter() - begun, failed_rank=rank, failed_code=code, preempted=preempted,
                             lost=tuple(lost))
    return RanksExit(time.perf_counter() - begun, preempted=preempted, lost=tuple(lost))


def _forward_signals(procs: list[subprocess.Popen], forwarded: list[tuple[int, float]]) -> dict[int, object]:
    """Pass a scheduler's warning on to the ranks (they checkpoint and stop), noting it and when in
    `forwarded`; returns the previous handlers.

    Only the main thread may install handlers; elsewhere the warning reaches whoever handles it there.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        forwarded.append((signum, time.perf_counter()))
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


class SaidOnce:
    """The `dptrain: error:` lines the ranks printed, so that the same line from another rank is not shown again:
    the ranks of one script (dptrain run) that make the same mistake, e.g. in a Trainer's arguments, before they
    form a group that would let one say it for all."""

    MARK = b"dptrain: error: "

    def __init__(self) -> None:
        self.lines: set[bytes] = set()
        self.lock = threading.Lock()

    def new(self, line: bytes) -> bool:
        """Whether to show `line`: any line but an error line another rank printed already."""
        if not line.startswith(self.MARK):
            return True
        with self.lock:
            seen = line.rstrip(b"\r\n") in self.lines
            self.lines.add(line.rstrip(b"\r\n"))
        return not seen


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes], silenced: Optional[threading.Event] = None,
          said: Optional[SaidOnce] = None) -> None:
    """Copy a worker's output to ours, prefixing every line (and every progress-bar redraw).

    Only whole lines (ending in \n or \r) are written, each batch in one write, so lines of
    different ranks never interleave mid-line; a partial line waits for its end. Once `silenced`
    is set, the rest is read and dropped. An error line another rank printed already (`said`) is dropped.
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
            sink.write(_prefixed(pending[:cut], prefix, said))
            sink.flush()
            pending = pending[cut:]
    if pending and not (silenced is not None and silenced.is_set()):
        sink.write(_prefixed(pending, prefix, said))
        sink.flush()


def _prefixed(data: bytes, prefix: bytes, said: Optional[SaidOnce] = None) -> bytes:
    """`prefix` before every line of `data` (which starts at a line start), but for an error line `said` already
    holds. A line that torch already tagged with the same rank (its C++ warnings and logs print
    "[rank1]:[W1204 ...] ...") keeps one tag, ours: "[rank1] [W1204 ...] ...", not "[rank1] [rank1]:[W1204 ...] ..."."""
    theirs = prefix[:-1] + b":" if re.fullmatch(rb"\[rank\d+\] ", prefix) else None
    lines = re.split(rb"(?<=[\r\n])", data)
    return b"".join(prefix + (line.removeprefix(theirs) if theirs else line) for line in lines
                    if line and (said is None or said.new(line)))
