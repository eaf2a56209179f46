"""Values dptrain reads from the rendezvous store, signed with the run's secret, so that only the run's own
processes move its membership.

torch's TCPStore has no authentication: any process that reaches its port can set any key. dptrain's own
decisions (who is alive, who decides, the members of a generation, who failed, who joins and is admitted,
a launcher's note that a rank's process ended, a peer's reported error, async's take-over) are written as
`VALUE|hmac=MAC`, MAC an HMAC-SHA256 of the key and the value under the run's secret, and a value read back
without a valid MAC is ignored, with one line naming the key. What a forger can still do is delay or stop the
run (delete keys, bump counters, take a group's rendezvous slot): docs/reference/security.md says so.

The secret is 32 random bytes (hex) in DPTRAIN_RUN_SECRET: made by the process that serves the store
(dptrain's launcher) or by the job script (SLURM, PBS) before the store and the ranks start, inherited by the
ranks; `dptrain join RUN_DIR` reads it from RUN_DIR/join.address (mode 0600: only the run's user can join).
A process without a secret (a run under plain torchrun, no live membership) signs nothing and checks nothing:
torch's own trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import time
from typing import Any, Optional

from dptrain.runtime.heartbeat import bounded

SECRET_ENV = "DPTRAIN_RUN_SECRET"
MARK = "|hmac="
_warned: set[str] = set()


def new_secret() -> str:
    return secrets.token_hex(32)


_made: Optional[str] = None  # the secret this process made for the ranks it starts (`ensure_secret`)


def ensure_secret() -> str:
    """The run secret of the ranks this process starts: its own (DPTRAIN_RUN_SECRET), or one made now (kept
    for this process, handed to the ranks in their environment by the caller)."""
    global _made
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    if _made is None:
        _made = new_secret()
    return _made


def current() -> Optional[str]:
    """The secret this process signs with, or None."""
    return os.environ.get(SECRET_ENV) or _made


def _secret() -> Optional[bytes]:
    value = current()
    return value.encode() if value else None


def _mac(secret: bytes, key: str, value: str) -> str:
    return hmac.new(secret, key.encode() + b"\0" + value.encode(), hashlib.sha256).hexdigest()


def sign(key: str, value: str) -> str:
    """`value` as it is written at `key`: with its MAC when this process has the run's secret."""
    secret = _secret()
    return value if secret is None else f"{value}{MARK}{_mac(secret, key, value)}"


def verify(key: str, raw: Any) -> Optional[str]:
    """The value written at `key` (`raw`, the store's bytes), or None when it is not signed with the run's
    secret (said once per key: another process wrote it)."""
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    value, mark, mac = text.rpartition(MARK)
    secret = _secret()
    if secret is None:
        return value if mark else text
    if mark and hmac.compare_digest(mac, _mac(secret, key, value)):
        return value
    if key not in _warned:
        _warned.add(key)
        print(f"dptrain: ignored the value at '{key}' in the run's store: it is not signed with the run's secret "
              "(another process wrote it)", file=sys.stderr, flush=True)
    return None


def put(store, key: str, value: str, timeout: Optional[float] = None) -> None:
    bounded(lambda: store.set(key, sign(key, value)), timeout)


def read(store, key: str, timeout: Optional[float] = None) -> Optional[str]:
    """The signed value at `key`, or None when there is none or it is forged."""
    if not bounded(lambda: store.check([key]), timeout):
        return None
    return verify(key, bounded(lambda: store.get(key), timeout))


def present(store, key: str, timeout: Optional[float] = None) -> bool:
    """Whether `key` holds a value signed with the run's secret (a forged one counts as none)."""
    return read(store, key, timeout) is not None


def wait_for(store, key: str, timeout: float, poll: float = 0.05) -> Optional[str]:
    """The signed value at `key` once one is there (a forged one is waited past), or None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = read(store, key)
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(poll)


CLAIM_TRIES = 20


class Contested(RuntimeError):
    """A key dptrain must agree on keeps being overwritten by a process without the run's secret."""


def claim(store, key: str, value: str, timeout: Optional[float] = None) -> str:
    """The first signed value set at `key` (this one, if it comes first), by the store's compare-and-set: one
    winner for every process of the run. A forged value there is replaced (compared against itself), so a
    forger cannot choose the winner; one that keeps writing only delays the run (PeerFailure after some tries)."""
    expected = ""
    for _ in range(CLAIM_TRIES):
        raw = bounded(lambda: store.compare_set(key, expected, sign(key, value)), timeout)
        won = verify(key, raw)
        if won is not None:
            return won
        expected = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    raise Contested(f"the key '{key}' in the run's store keeps being overwritten by a process without the run's "
                      "secret; the run cannot agree on it")
