"""`dptrain ARGS` signalled (SIGTERM) the moment it has started its first rank, and what it left behind.

The command runs under a process of its own that is the subreaper of what it starts (PR_SET_CHILD_SUBREAPER):
a rank the launcher leaves behind becomes that process's child, listed (alive or a zombie) once the launcher
has exited, then killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

_SIGNAL_THE_LAUNCHER = """
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1)
extra, argv = float(sys.argv[1]), sys.argv[2:]
proc = subprocess.Popen([sys.executable, "-m", "dptrain", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
children = f"/proc/{proc.pid}/task/{proc.pid}/children"
while proc.poll() is None and not open(children).read().split():  # until the launcher started its first rank
    time.sleep(0.0005)
time.sleep(extra)
proc.send_signal(signal.SIGTERM)
out, err = proc.communicate()
me = os.getpid()
left = open(f"/proc/{me}/task/{me}/children").read().split()
for pid in left:
    os.kill(int(pid), signal.SIGKILL)
print(json.dumps({"code": proc.returncode, "stderr": err, "left": left}))
"""


def signal_when_started(args: Sequence[str], cwd: Path, extra: float = 0.0, timeout: float = 180) -> dict:
    """SIGTERM to `python -m dptrain ARGS` `extra` s after it started its first rank: {"code": its exit code,
    "stderr": its stderr, "left": the processes it left behind (their PIDs)}."""
    result = subprocess.run([sys.executable, "-c", _SIGNAL_THE_LAUNCHER, str(extra), *args], cwd=cwd,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
