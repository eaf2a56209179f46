"""Reproduce the SLURM requeue race: send the stop warning (scancel --signal) at many moments of a two-node job
and record how each job ended: requeued, or finished with which state and exit code.

Without SLURM_CONF in the environment it starts its own cluster (munged, slurmctld, two slurmd) and, with
--container, a udocker container, as the tests do (tests/cluster_fixtures.py), and stops them at the end.
Trials run one after the other; each job is cancelled once it went back to the queue.

    python benchmarks/requeue_race.py --trials 52 --first 0.3 --last 12 --container --out race.jsonl

Issue 23 item 5, measured with it (udocker, 3 epochs of digits, two CPU cores shared with a full test run):
before the fix, of 17 jobs (warning 0.5 to 5.9 s after the start) 15 stopped and 5 of those ended FAILED
with 143 ("task N: Terminated" after srun's "Terminating StepId" when the other rank exited with 75 first);
after it, of 52 jobs (0.3 to 12 s) 50 stopped and all 50 were requeued. The other two got the warning
before the job step existed: it was lost and they ran to the end (COMPLETED).
On the host (no --container, warning 0.1 to 1.0 s after the start, 20 jobs): before, 6 ended FAILED with
138 (SIGUSR1 killed a rank whose interpreter was still starting); after, 18 were requeued and 2 lost it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def scontrol(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def wait_state(job_id: str, done, what: str, timeout: float, poll: float = 0.05) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = scontrol(job_id)
        if done(fields):
            return fields
        time.sleep(poll)
    raise RuntimeError(f"job {job_id}: no {what} within {timeout:g} s")


def trial(delay: float, args, workdir: Path) -> dict:
    command = [sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2", "--tasks-per-node", "1",
               "--dptrain", f"{sys.executable} -m dptrain", "--submit"]
    if args.container:
        command += ["--container", f"udocker:{args.container}", *[w for b in args.bind for w in ("--bind", b)]]
    if args.stop_signal != "USR1":
        command += ["--stop-signal", args.stop_signal]
    command += ["--", "--dataset", "digits", "--model", "mlp", "--epochs", str(args.epochs), "--batch-size", "32",
                "--strategy", "sync", "--timeout", "120", "--out", "run"]
    out = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    job_id = out.stdout.split("submitted job ")[1].split(";")[0].split()[0]
    running = wait_state(job_id, lambda f: f.get("JobState") != "PENDING", "start", 120)
    started = time.monotonic()
    time.sleep(delay)
    sent = subprocess.run(["scancel", f"--signal={args.stop_signal}", job_id], capture_output=True, text=True, timeout=30)
    sent_at = time.monotonic() - started
    end = wait_state(job_id, lambda f: f.get("JobState") not in ("RUNNING", "COMPLETING", "CONFIGURING")
                     or f.get("Restarts", "0") != "0", "end or requeue", 300, poll=0.2)
    requeued = end.get("Restarts", "0") != "0"
    if requeued or end.get("JobState") == "PENDING":
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    log = next((workdir / "run").glob("slurm-*.out"), None)
    text = log.read_text(errors="replace") if log else ""
    return {"delay": round(delay, 3), "sent_at": round(sent_at, 3), "job": job_id, "first_state": running.get("JobState"),
            "state": end.get("JobState"), "exit": end.get("ExitCode"), "requeued": requeued,
            "scancel": (sent.stdout + sent.stderr).strip()[-200:],
            "stopped": "stopped by SIG" in text, "srun_errors": [l for l in text.splitlines() if l.startswith("srun:")][-6:]}


@contextlib.contextmanager
def cluster(args, root: Path):
    """The cluster (and container) of SLURM_CONF and UDOCKER_DIR, or ones started here, as the tests do."""
    if os.environ.get("SLURM_CONF"):
        yield
        return
    sys.path.insert(0, str(REPO / "tests"))
    import cluster_fixtures  # noqa: E402 - the tests' cluster, on purpose

    started = cluster_fixtures.start_slurm(root / "slurm")
    try:
        os.environ["SLURM_CONF"] = started.env["SLURM_CONF"]
        if args.container:
            tarball = root / "rootfs.tar.gz"
            cluster_fixtures.build_rootfs(tarball)
            os.environ["UDOCKER_DIR"] = str(root / "udocker")
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            subprocess.run([sys.executable, "-m", "dptrain", "container", "setup", "--image", str(tarball), "--name",
                            args.container], check=True, capture_output=True, timeout=300)
            args.bind = [*cluster_fixtures.runtime_dirs(), *args.bind]
        yield
    finally:
        cluster_fixtures.stop_slurm(started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=52)
    parser.add_argument("--first", type=float, default=0.3, help="the first trial's delay after the job started (s)")
    parser.add_argument("--last", type=float, default=12.0, help="the last trial's delay; the others lie evenly between")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--container", nargs="?", const="dptrain-race", default="",
                        help="a udocker container's name (alone: one set up here); none: ranks on the host")
    parser.add_argument("--bind", action="append", default=[], help="a directory the container must see")
    parser.add_argument("--stop-signal", default="USR1", choices=["USR1", "USR2", "TERM"])
    parser.add_argument("--out", type=Path, required=True, help="one JSON line per trial is appended here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="race-cluster-") as root, cluster(args, Path(root)):
        for index in range(args.trials):
            delay = args.first + (args.last - args.first) * index / max(1, args.trials - 1)
            with tempfile.TemporaryDirectory(prefix="race-") as tmp:
                record = trial(delay, args, Path(tmp))
            with args.out.open("a") as sink:
                sink.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
