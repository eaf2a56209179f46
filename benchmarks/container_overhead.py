"""What a container costs: the same 2-rank cnn job bare and with one container per rank, as whole processes.

    python benchmarks/container_overhead.py benchmarks/results/container_overhead.json --repeats 3

Every variant runs `dptrain launch --scheduler local --tasks-per-node 2 --submit --wait -- --dataset digits
--model cnn --epochs E --batch-size 32 --no-progress`:

* `bare`: no container;
* `udocker:MODE`: one udocker container per rank, the container set up by `dptrain container setup
  --execmode MODE` (P1: PRoot with seccomp, P2: PRoot tracing every call, F1-F4: Fakechroot, R1: runc);
  a mode whose set-up or first run fails here is recorded with its one-line reason and not timed;
* `charliecloud`: one `ch-run` per rank (where ch-run is installed).

Each container is made from the tests' tiny root filesystem (busybox and /etc) with this machine's Python,
venv and libraries bound in, as tests/test_udocker.py does, so nothing is downloaded. Each repeat runs every
variant once in each condition, the order rotated from repeat to repeat (interleaved, so a busy moment of a
shared machine falls on all alike): `quiet` (nothing of ours beside it) and `busy` (one CPU burner per core
for the run's whole length, as on a cluster node where every core works). Per run: wall seconds of the
whole process, CPU seconds of it and all its descendants (the burners excluded), samples/s from
summary.json, and start-up: wall seconds less the epochs' own seconds (metrics.jsonl), i.e. starting the
ranks (and their containers), evaluating, writing and ending. The load average at each start is kept,
since other people's work on the machine shows in every number. The JSON keeps one entry per --label.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from cluster_fixtures import build_rootfs, runtime_dirs  # noqa: E402 - the tests' image and binds

UDOCKER_MODES = ("P1", "P2", "F1", "F2", "F3", "F4", "R1")
BURNER = "while True: pass"


def job(epochs: int) -> list[str]:
    return ["--dataset", "digits", "--model", "cnn", "--epochs", str(epochs), "--batch-size", "32", "--no-progress"]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and "autoinstall disabled" not in line]
    return lines[-1] if lines else "no output"


def prepare(work: Path, env: dict[str, str], modes: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(variant: extra `dptrain launch` words, variant: why it cannot run here)."""
    binds = [word for path in runtime_dirs() for word in ("--bind", path)]
    inside = ["--dptrain", f"{sys.executable} -m dptrain"]
    variants: dict[str, list[str]] = {"bare": []}
    failed: dict[str, str] = {}
    tarball = work / "rootfs.tar.gz"
    build_rootfs(tarball)
    for mode in modes:
        name = f"bench-{mode.lower()}"
        done = subprocess.run([sys.executable, "-m", "dptrain", "container", "setup", "--image", str(tarball),
                               "--name", name, "--execmode", mode], env=env, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            failed[f"udocker:{mode}"] = last_line(done.stdout + done.stderr)
            continue
        check = subprocess.run([sys.executable, "-m", "dptrain", "container", "check", "--name", name, *inside, *binds],
                               env=env, capture_output=True, text=True, timeout=300)
        if check.returncode != 0:
            failed[f"udocker:{mode}"] = last_line(check.stdout + check.stderr)
            continue
        variants[f"udocker:{mode}"] = ["--container", f"udocker:{name}", *binds, *inside]
    if shutil.which("ch-run"):
        image = work / "ch-image"
        image.mkdir()
        subprocess.run(["tar", "-xzf", str(tarball), "-C", str(image)], check=True, timeout=120)
        variants["charliecloud"] = ["--container", f"charliecloud:{image}", *binds, *inside]
    else:
        failed["charliecloud"] = "ch-run is not installed"
    return variants, failed


def run_once(variant: str, words: list[str], epochs: int, work: Path, env: dict[str, str], busy: bool) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(os.cpu_count() or 1)] if busy else []
    try:
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "local", "--tasks-per-node",
                               "2", *words, "--out", str(out / "run"), "--submit", "--wait", "--wait-timeout", "600",
                               "--", *job(epochs)], cwd=out, env=env, capture_output=True, text=True, timeout=660)
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait(timeout=30)
    record = {"variant": variant, "condition": "busy" if busy else "quiet", "load_at_start": round(load, 2),
              "exit": done.returncode, "wall_seconds": round(wall, 3),
              "cpu_seconds": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 3)}
    if done.returncode != 0:
        record["error"] = last_line(done.stdout + done.stderr)
        return record
    summary = json.loads((out / "run" / "summary.json").read_text())
    epoch_seconds = sum(json.loads(line)["epoch_seconds"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines())
    record.update(samples_per_second=round(summary["samples_per_second"], 1),
                  startup_seconds=round(wall - epoch_seconds, 3), test_accuracy=summary["test_accuracy"])
    shutil.rmtree(out, ignore_errors=True)
    return record


def ratios(runs: list[dict]) -> dict:
    """Per condition and variant: medians, and throughput, CPU seconds and start-up as ratios to bare's medians."""
    table: dict[str, dict] = {}
    for condition in ("quiet", "busy"):
        good = [run for run in runs if run["condition"] == condition and run["exit"] == 0]
        medians = {}
        for variant in dict.fromkeys(run["variant"] for run in good):
            mine = [run for run in good if run["variant"] == variant]
            medians[variant] = {key: statistics.median(run[key] for run in mine)
                                for key in ("samples_per_second", "cpu_seconds", "startup_seconds", "wall_seconds")}
            medians[variant]["runs"] = len(mine)
        bare = medians.get("bare")
        for variant, median in medians.items():
            if bare:
                median["throughput_vs_bare"] = round(median["samples_per_second"] / bare["samples_per_second"], 3)
                median["cpu_seconds_vs_bare"] = round(median["cpu_seconds"] / bare["cpu_seconds"], 3)
                median["startup_vs_bare"] = round(median["startup_seconds"] / bare["startup_seconds"], 3)
        table[condition] = medians
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="results JSON (one entry per --label is kept)")
    parser.add_argument("--label", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--modes", default=",".join(UDOCKER_MODES), help="udocker modes to try (comma-separated)")
    parser.add_argument("--conditions", default="quiet,busy")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="container-overhead-"))
    env = {**os.environ, "UDOCKER_DIR": str(work / "udocker"), "USER": os.environ.get("USER") or "root",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        variants, failed = prepare(work, env, [mode for mode in args.modes.split(",") if mode])
        for variant, why in failed.items():
            print(f"{variant}: cannot run here: {why}", flush=True)
        runs = []
        names = list(variants)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for condition, variant in itertools.product(args.conditions.split(","), order):
                record = run_once(variant, variants[variant], args.epochs, work, env, busy=condition == "busy")
                record["repeat"] = repeat
                runs.append(record)
                print(json.dumps(record), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    entry = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
             "cpus": os.cpu_count(), "epochs": args.epochs, "repeats": args.repeats, "job": job(args.epochs),
             "cannot_run_here": failed, "summary": ratios(runs), "runs": runs}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(entry["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
