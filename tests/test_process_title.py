"""Each worker's rank is in its process title (ps, top), not only `python -m dptrain` for all of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cmdline(entry: Path) -> str:
    return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def _titles() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
            except OSError:
                continue
    return found


def test_each_worker_shows_its_rank_in_its_process_title(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TITLE_PROBE"] = "kept"
    out = str(tmp_path / "titled")
    run = subprocess.Popen([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2",
                            "--strategy", "sync", "--epochs", "200", "--no-progress", "--out", out], cwd=tmp_path,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # The title takes the command line's room only (`python -m dptrain` here), so the directory may be cut short.
    wanted = {rank: f"dptrain train rank {rank}/2 sync {out}" for rank in (0, 1)}

    def titled() -> dict[int, Path]:
        found = {}
        for entry in Path("/proc").iterdir():
            try:
                title = _cmdline(entry) if entry.name.isdigit() else ""
            except OSError:
                continue
            for rank, full in wanted.items():
                if title.startswith(f"dptrain train rank {rank}/2 sync") and full.startswith(title):
                    found[rank] = entry
        return found

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(titled()) < 2:
            time.sleep(0.2)
        assert len(titled()) == 2, [t for t in _titles() if "dptrain" in t]
        for entry in titled().values():
            # the process name (comm) has no space: /proc/PID/stat split on spaces keeps its parent (SLURM's
            # proctrack/linuxproc finds a step's processes so, and signals them)
            assert (entry / "comm").read_text().strip() == "dptrain"
            assert (entry / "stat").read_text().split()[3].isdigit()  # the parent's pid, in field 4
            # and the environment a monitoring tool reads is the rank's own, not overwritten by the title
            assert b"TITLE_PROBE=kept" in (entry / "environ").read_bytes().split(b"\0")
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
