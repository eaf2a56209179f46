"""Heartbeats through the rendezvous store, so a failed collective can name the rank that is missing.

Each rank bumps a counter in the torch.distributed store every `interval` seconds from a
daemon thread. After a collective fails or times out, `silent_peers()` reads all counters
twice, a few intervals apart: ranks whose counter did not move are dead or frozen. Counters,
not timestamps, so clocks of different nodes need not agree.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch.distributed as dist

PREFIX = "dptrain/heartbeat/"


def default_store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class Heartbeat:
    """Beat for this rank; ask which peers went quiet."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._beat, name=f"dptrain-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread: it must not be inside a store call when the
        process group (and its store) is torn down, or the C++ runtime aborts the process."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(PREFIX + str(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store host is gone; the training thread reports it
                return
            self._stop.wait(self.interval)

    def stalled(self, peers, seconds: float) -> list[int]:
        """Peers whose counter has not moved for `seconds`, tracked across calls (poll it often)."""
        now = time.monotonic()
        silent = []
        for peer in peers:
            count = self.store.add(PREFIX + str(peer), 0)
            last = self._seen.get(peer)
            if last is None or last[0] != count:
                self._seen[peer] = (count, now)
            elif now - last[1] >= seconds:
                silent.append(peer)
        return silent

    def _counters(self) -> dict[int, int]:
        counts = {}
        for peer in range(self.world_size):
            if peer != self.rank:
                counts[peer] = self.store.add(PREFIX + str(peer), 0)  # add 0: read without blocking
        return counts

    def silent_peers(self, wait_intervals: float = 3.0) -> str:
        """A phrase naming the peers that stopped beating, or why nobody can be named."""
        try:
            first = self._counters()
            time.sleep(self.interval * wait_intervals)
            second = self._counters()
        except Exception:  # noqa: BLE001 - any store failure means the store's host is unreachable
            return "the rendezvous store on rank 0's host is unreachable, so rank 0 is probably gone"
        silent = [peer for peer in first if second[peer] == first[peer]]
        if not silent:
            return "every peer is still alive, so one is stuck in other work or waiting elsewhere"
        names = ", ".join(str(peer) for peer in silent)
        return f"rank{'s' if len(silent) > 1 else ''} {names} stopped responding (no heartbeat for " \
               f"{self.interval * wait_intervals:.0f} s)"
