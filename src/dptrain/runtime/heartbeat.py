"""Heartbeats through the rendezvous store, so a failed collective can name the rank that is missing.

Each rank bumps a counter in the torch.distributed store every `interval` seconds from one
long-lived daemon thread. After a collective fails or times out, `silent_peers()` reads all counters
twice, a few intervals apart: ranks whose counter did not move are dead or frozen. Counters,
not timestamps, so clocks of different nodes need not agree.

Every store call the training thread makes has a deadline (`bounded`): torch's TCPStore applies
its timeout to get/wait only, so `add` on a store whose host is frozen (SIGSTOP, swapped out, a
hung node) waits forever, and the diagnosis of a failed collective would hang instead of naming
rank 0. The beating thread calls the store itself (a thread per beat would start W threads a
second across a job): if a beat does not return, only that thread waits, and `stop` leaves it
behind after the same deadline, as `bounded` does.

Reading the peers' counters costs two store round trips whatever the world size (`check` that
every key exists, then one `multi_get`), not one per peer: every rank of a watched collective
polls them twice a second, which was W² round trips a second for the store's host.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from dptrain.runtime.store_keys import HEARTBEAT as PREFIX  # noqa: E402
STORE_DEADLINE = 5.0  # seconds; a store round trip takes well under a millisecond when its host runs
UNANSWERED = "rank 0 (the rendezvous store's host) does not answer"
T = TypeVar("T")


class StoreUnanswered(RuntimeError):
    """The rendezvous store did not answer a call within its deadline."""


_ABANDONED: list[threading.Thread] = []  # threads left inside a store call that never returned


def bounded(call: Callable[[], T], seconds: float = STORE_DEADLINE) -> T:
    """`call()` (a store call) in a daemon thread; StoreUnanswered if it has not returned after `seconds`.

    A store call cannot be interrupted, so a thread that misses its deadline is left behind,
    blocked; `store_abandoned()` tells the teardown not to destroy the store under it.
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="dptrain-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _ABANDONED.append(thread)
        raise StoreUnanswered(f"{UNANSWERED} within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def store_abandoned() -> bool:
    """Whether a store call of this process is still blocked (its host froze or vanished)."""
    return any(thread.is_alive() for thread in _ABANDONED)


def default_store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class Heartbeat:
    """Beat for this rank; ask which peers went quiet."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._peers: Optional[list[int]] = None  # the live members, once a rank left (None: every rank)
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}
        self.beats = 0  # store round trips of the beating thread (benchmarks/scale.py reports them)
        self.slowest_beat = 0.0  # seconds: the longest of them
        self._thread = threading.Thread(target=self._beat, name=f"dptrain-heartbeat-{rank}", daemon=True)

    @property
    def peers(self) -> Optional[list[int]]:
        return self._peers

    def follow(self, members) -> None:
        """Watch only `members` (ranks of the job) from now on: the job's members after a membership change."""
        self._peers = list(members)
        self._seen = {peer: seen for peer, seen in self._seen.items() if peer in self._peers}

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread: it must not be inside a store call when the
        process group (and its store) is torn down, or the C++ runtime aborts the process.
        A thread still inside a call after STORE_DEADLINE is left behind (`store_abandoned`)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_DEADLINE)
            if self._thread.is_alive():
                _ABANDONED.append(self._thread)

    def _beat(self) -> None:
        key = PREFIX + str(self.rank)
        while not self._stop.is_set():
            begun = time.monotonic()
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store host is gone; the training thread reports it
                return
            self.beats += 1
            self.slowest_beat = max(self.slowest_beat, time.monotonic() - begun)
            self._stop.wait(self.interval)

    def stalled(self, peers, seconds: float) -> list[int]:
        """Peers whose counter has not moved for `seconds`, tracked across calls (poll it often)."""
        now = time.monotonic()
        silent = []
        for peer, count in self.counters(peers).items():
            last = self._seen.get(peer)
            if last is None or last[0] != count:
                self._seen[peer] = (count, now)
            elif now - last[1] >= seconds:
                silent.append(peer)
        return silent

    def counters(self, peers) -> dict[int, int]:
        """Each of `peers`' heartbeat count (0 before its first beat), each call bounded.

        Two round trips when every peer has beaten (the usual case), one per peer only before that:
        `multi_get` would wait for a key that does not exist yet, `add(key, 0)` reads without waiting.
        """
        peers = list(peers)
        if not peers:
            return {}
        keys = [PREFIX + str(peer) for peer in peers]
        if bounded(lambda: self.store.check(keys)):
            values = bounded(lambda: self.store.multi_get(keys))
            return {peer: int(value) for peer, value in zip(peers, values)}
        return bounded(lambda: {peer: self.store.add(key, 0) for peer, key in zip(peers, keys)})

    def _counters(self) -> dict[int, int]:
        return self.counters(peer for peer in (self._peers or range(self.world_size)) if peer != self.rank)

    def silent_peers(self, wait_intervals: float = 3.0) -> str:
        """A phrase naming the peers that stopped beating, or why nobody can be named."""
        try:
            first = self._counters()
            time.sleep(self.interval * wait_intervals)
            second = self._counters()
        except StoreUnanswered:
            return UNANSWERED
        except Exception:  # noqa: BLE001 - any store failure means the store's host is unreachable
            return "the rendezvous store on rank 0's host is unreachable, so rank 0 is probably gone"
        silent = [peer for peer in first if second[peer] == first[peer]]
        if not silent:
            return "every peer is still alive, so one is stuck in other work or waiting elsewhere"
        names = ", ".join(str(peer) for peer in silent)
        return f"rank{'s' if len(silent) > 1 else ''} {names} stopped responding (no heartbeat for " \
               f"{self.interval * wait_intervals:.0f} s)"
