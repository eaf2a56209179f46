"""Pre-emption: SIGTERM/SIGUSR1/SIGUSR2 (a scheduler's warning before the time limit) ask for a checkpoint and a clean stop.

A signal only sets a flag; the loop looks at it at each epoch end, where the strategy decides
how ranks agree on it (dptrain.strategies.base.Strategy.agree_stop). A signal that arrives
while the process still starts up (imports, rendezvous, data) is remembered from the
earliest moment `catch_stop_signals_early` runs and honoured at the first epoch end.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

from dptrain.runtime.spawn import FORWARDED_SIGNALS

STOP_SIGNALS = FORWARDED_SIGNALS  # SIGTERM, SIGUSR1, SIGUSR2: whatever a launcher passes on
_EARLY_STOP: list[str] = []  # stop signals that arrived before a StopSignals watched for them


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def catch_stop_signals_early() -> None:
    """From now on SIGTERM/SIGUSR1/SIGUSR2 are remembered rather than fatal, until a StopSignals takes over."""
    if not _on_main_thread():
        return

    def remember(signum, frame):
        _EARLY_STOP.append(signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        signal.signal(signum, remember)


def take_early_stop_signal() -> Optional[str]:
    """The first stop signal remembered since `catch_stop_signals_early` (its name), now the caller's to honour."""
    name = _EARLY_STOP[0] if _EARLY_STOP else None
    _EARLY_STOP.clear()
    return name


def release_early_stop_signals() -> None:
    """Give SIGTERM/SIGUSR1/SIGUSR2 their default action back (a process that will not checkpoint);
    one that arrived meanwhile takes effect now."""
    if not _on_main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if _EARLY_STOP:
        name = _EARLY_STOP[0]
        _EARLY_STOP.clear()
        os.kill(os.getpid(), signal.Signals[name])


class StopSignals:
    """Watches for stop signals (only on the main thread: Python delivers signals there)."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None

    def watch(self) -> None:
        if not _on_main_thread():
            return

        def request_stop(signum, frame):
            self.requested = signal.Signals(signum).name

        for signum in STOP_SIGNALS:
            signal.signal(signum, request_stop)
        if _EARLY_STOP:  # it came while the process was still starting
            self.requested = _EARLY_STOP[0]
            _EARLY_STOP.clear()
