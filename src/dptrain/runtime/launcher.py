"""The local launchers: spawn N ranks on this machine, as torchrun would, but quieter.

`dptrain train` runs its workers as `python -m dptrain train ...` (launch_local; or gives workers
started ahead of time, dptrain.runtime.prestart, their arguments instead); `dptrain run`
runs a user's script (dptrain.run_command). Both go through the one spawner
(dptrain.runtime.spawn), their output prefixed with the rank; if a rank fails, the others are
stopped and one line (say_how_ranks_ended) names the rank that failed first, or the ranks
still running long after another one ended well. A stop signal (SIGTERM, SIGUSR1, SIGUSR2) is handled from
before the first rank starts: until the ranks have their work it stops them and the launcher (one line, exit
75, stop_while_starting); after, it is passed on to them, and they checkpoint and stop (75 too).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from dptrain.errors import Interrupted, Preempted, StoppedStarting, UserError
from dptrain.runtime.prestart import release
from dptrain.io import write_text
from dptrain.runtime.spawn import FORWARDED_SIGNALS, Ranks, RanksExit, describe_exit, start_ranks, store_listener

# Exit codes after which a launcher does not restart its ranks: done, bad input (the same again),
# stopped on request to be requeued, Ctrl-C.
NOT_RESTARTED = (0, UserError.exit_code, Preempted.exit_code, Interrupted.exit_code)
_STOPPED: list[str] = []  # the stop signal that stop_while_starting's handler raised as StoppedStarting (its name)


def stop_while_starting(pending: Callable[[], Optional[str]] = lambda: None) -> None:
    """In a launcher, until its ranks have their work (`launch_local` then passes stop signals on to them): a stop
    signal raises StoppedStarting, so that whoever started ranks closes (kills) them on the way out and the
    launcher ends with one line and 75; `pending()`, asked once the handlers are in place (no moment between is
    left uncovered), names one that came earlier, and raises it now. Further signals are noted and dropped: the
    launcher is stopping already, and must not die before its ranks are gone.

    An exception raised by a signal handler surfaces wherever the main thread happens to be, and library code
    there may swallow it (measured: one raised inside numpy's Cython module initialisation, during an import,
    vanished and the run trained on). So the stop is also remembered, and `launch_local` raises it again before
    it releases the ranks (`raise_if_stopped_while_starting`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _STOPPED.clear()

    def stop(signum, frame):
        for other in FORWARDED_SIGNALS:
            signal.signal(other, lambda *_: None)
        _STOPPED.append(signal.Signals(signum).name)
        raise StoppedStarting(_STOPPED[0])

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, stop)
    name = pending()
    if name is not None:
        stop(signal.Signals[name], None)


def raise_if_stopped_while_starting() -> None:
    """StoppedStarting again, for a stop signal that `stop_while_starting` turned into one which never arrived."""
    if _STOPPED:
        raise StoppedStarting(_STOPPED[0])


def join_record(host: str, port) -> str:
    """What RUN_DIR/join.address holds while a run takes joiners: where its store is, and the run's secret that
    a joiner signs with (the file is its user's alone, so only that user's `dptrain join` can enter)."""
    from dptrain.runtime import signed

    secret = signed.current()
    return f"{host}:{port}\n" + (f"{secret}\n" if secret else "")


def read_join_record(text: str) -> tuple[str, str, str]:
    """(host, port, secret) from what `join_record` wrote (the secret "" where the run has none)."""
    where, _, secret = text.strip().partition("\n")
    host, _, port = where.strip().rpartition(":")
    return host, port, secret.strip()


def launch_local(workers: int, argv: Sequence[str], timeout: float = 300.0, prestarted: Optional[Ranks] = None,
                 may_lose: int = 0, grace: Optional[float] = None, replacements: int = 0,
                 join_file: Optional[Path] = None, unit: int = 1) -> int:
    """Run `python -m dptrain ARGV` as `workers` ranks; return 0, 75 (stopped at a checkpoint) or the first failure's code.

    `prestarted`: ranks started by dptrain.runtime.prestart.prestart(workers), released here
    with ARGV (and closed). Once one rank has ended well, the others must end within `timeout`
    seconds (they have no one left to wait for): a rank frozen after the last collective is
    stopped and named. Up to `may_lose` ranks may fail without stopping the others (--min-workers: they
    go on without it); each is named in one line. This process then serves the ranks' store, so that
    rank 0 may be one of them, and writes where it listens to `join_file` while the ranks run (`dptrain
    join`); up to `replacements` failed ranks are replaced by a new worker each (--replace-workers), which
    joins the others at an epoch end; with `unit` S (--shard hybrid: a rank's replica group is lost with it), each
    lost rank's group is replaced by S new ranks, while S of the `replacements` are left. With `grace`, ranks still
    running
    that long after a stop signal was passed on to them are killed and named (--grace).
    """
    try:
        ranks = prestarted
        if ranks is None:
            listener = store_listener()
            ranks = start_ranks([sys.executable, "-m", "dptrain", *argv], workers, port=listener.getsockname()[1],
                                listener=listener, serve_store=may_lose > 0, sessions=True)
        left = [replacements]

        def replace(lost: int) -> Optional[tuple[int, ...]]:
            if left[0] < unit:
                return None
            left[0] -= unit
            return ranks.start_joiners(argv, lost, unit)

        try:
            ranks.pass_on_stop_signals()  # from now on a stop signal is the ranks' to honour (a checkpoint first)
            raise_if_stopped_while_starting()  # one that came before, its exception swallowed on the way
            ranks.serve_store(timeout)  # when started to join a store served here (prestart, may_lose)
            if prestarted is not None:
                release(prestarted, list(argv), {})
            if join_file is not None and ranks.address is not None:
                write_text(join_file, join_record(*ranks.address))
            ended = ranks.wait(linger=timeout, may_lose=may_lose, grace=grace,
                               replacement=replace if replacements else None)
        finally:
            ranks.close()
            if join_file is not None:
                join_file.unlink(missing_ok=True)
    except KeyboardInterrupt:
        return Interrupted.exit_code
    say_how_ranks_ended(ended, timeout, grace=grace)
    return ended.code


def say_how_ranks_ended(ended: RanksExit, linger: float, *, noun: str = "worker rank", of: str = "",
                        others: str = "the other workers", grace: Optional[float] = None) -> None:
    """One line on stderr for a failed rank, for ranks still running `linger` s after one ended well, or for
    ranks still running `grace` s after a stop signal; else nothing.

    The ranks are named "`noun` N`of`" ("worker rank 1", "rank 1 of `python train.py`").
    """
    if ended.failed_rank is not None:
        print(f"dptrain: {noun} {ended.failed_rank}{of} {describe_exit(ended.failed_code)}; stopping {others}",
              file=sys.stderr, flush=True)
    if ended.stuck_ranks:
        many = len(ended.stuck_ranks) > 1
        names = ", ".join(map(str, ended.stuck_ranks))
        print(f"dptrain: {noun}{'s' if many else ''} {names}{of} had not ended {linger:g} s after rank "
              f"{ended.first_done} did (frozen or stuck); stopping {'them' if many else 'it'}",
              file=sys.stderr, flush=True)
    if ended.unstopped and ended.stop_signal is not None:
        many = len(ended.unstopped) > 1
        names = ", ".join(map(str, ended.unstopped))
        print(f"dptrain: {noun}{'s' if many else ''} {names}{of} had not exited {grace:g} s (--grace) after "
              f"{signal.Signals(ended.stop_signal).name}; killing {'them' if many else 'it'}",
              file=sys.stderr, flush=True)
