"""Start-up of a one-epoch digits run, timed as whole processes: `dptrain train` against torchrun.

    python benchmarks/startup.py benchmarks/results/startup.json --label after --repeats 7 \\
        --dptrain before=/tmp/startup-before/src --dptrain after=src

Each repeat runs every variant once, in the same order (interleaved, so a busy moment of a
shared machine falls on all of them alike), and times the whole process from start to exit:

* `dptrain[NAME]`: `python -m dptrain train --dataset digits --model mlp --workers 2 --epochs 1
  --no-progress --out TMP` with PYTHONPATH=SRC, for each `--dptrain NAME=SRC` (several source
  trees, e.g. before and after a change, in one session);
* `torchrun textbook`: `torchrun --nproc-per-node 2 baselines/textbook_ddp.py` (scikit-learn's
  digits, a DistributedSampler, DDP, gloo, the same MLP, batch size and epoch, test accuracy at
  the end; nothing of dptrain);
* `torchrun plain_ddp[NAME]`: the bench's plain-DDP baseline (`baselines/plain_ddp.py --epochs 1`),
  which takes its data set and model from dptrain: from each tree named by --plain-ddp NAME
  (default: the first tree; --no-plain-ddp leaves it out).

Every tree is byte-compiled first (`compileall`), as an installed package is, so no process
pays for compiling dptrain's sources. Also recorded per run: when the first line of output
appeared, and for dptrain when the '[rank0] epoch 1/1' line did. The JSON keeps one entry per
`--label`, so a later session adds to the file without replacing what it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "2", "--epochs", "1", "--no-progress"]


def timed(command: list[str], env: dict[str, str], marks: dict[str, str]) -> dict:
    """Run `command`; its wall seconds, exit code, and when the first output line and each of `marks` appeared."""
    began = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read():
        for raw in proc.stdout:
            now = time.perf_counter() - began
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            seen.setdefault("first_output", now)
            for name, text in marks.items():
                if text in line:
                    seen.setdefault(name, now)

    reader = threading.Thread(target=read)
    reader.start()
    code = proc.wait()
    wall = time.perf_counter() - began
    reader.join()
    run = {"seconds": round(wall, 3), "code": code, **{f"{k}_s": round(v, 3) for k, v in seen.items()}}
    if code != 0:
        run["output_tail"] = lines[-5:]
    return run


def variants(args) -> list[tuple[str, list[str], dict[str, str], dict[str, str]]]:
    """(name, command, extra environment, marks) of every variant of one repeat."""
    python = sys.executable
    torchrun = str(Path(python).with_name("torchrun"))
    out = []
    for name, src in args.dptrain:
        out.append((f"dptrain[{name}]", [python, "-m", "dptrain", *TRAIN, "--out", "{tmp}"], {"PYTHONPATH": src},
                    {"starting": "starting", "first_epoch": "epoch 1/1"}))
    out.append(("torchrun textbook", [torchrun, "--nproc-per-node", "2", str(HERE / "baselines" / "textbook_ddp.py")],
                {}, {"accuracy": "test accuracy"}))
    trees = dict(args.dptrain)
    for name in (args.plain_ddp or [args.dptrain[0][0]]) if args.plain_ddp is not False else []:
        out.append((f"torchrun plain_ddp[{name}]", [torchrun, "--nproc-per-node", "2",
                                                   str(HERE / "baselines" / "plain_ddp.py"), "--epochs", "1",
                                                   "--out", "{tmp}"], {"PYTHONPATH": trees[name]}, {}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file; the entry of --label is replaced, others are kept")
    parser.add_argument("--label", required=True, help="name of this session's entry, e.g. before or after")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dptrain", action="append", default=[], metavar="NAME=SRC",
                        help="a dptrain source tree to time (repeatable); default: this repository's src")
    parser.add_argument("--plain-ddp", action="append", default=[], metavar="NAME",
                        help="time the plain-DDP baseline with this dptrain tree's data set and model (repeatable)")
    parser.add_argument("--no-plain-ddp", dest="plain_ddp", action="store_false")
    parser.add_argument("--note", default="", help="free text kept with the entry (e.g. how busy the machine was)")
    args = parser.parse_args()
    args.dptrain = [tuple(item.split("=", 1)) for item in args.dptrain] or [("src", str(HERE.parent / "src"))]
    args.dptrain = [(name, str(Path(src).resolve())) for name, src in args.dptrain]
    for _, src in args.dptrain:
        subprocess.run([sys.executable, "-m", "compileall", "-q", src], check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE / "baselines")], check=True)

    base = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    runs: dict[str, list[dict]] = {}
    loads = []
    for repeat in range(args.repeats):
        for name, command, extra, marks in variants(args):
            tmp = tempfile.mkdtemp(prefix="startup-")
            try:
                run = timed([part.replace("{tmp}", str(Path(tmp) / "run")) for part in command],
                            {**base, **extra}, marks)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            run["load_before"] = round(os.getloadavg()[0], 2)
            loads.append(run["load_before"])
            runs.setdefault(name, []).append(run)
            print(f"{repeat + 1}/{args.repeats}  {name:28s} {run['seconds']:6.2f} s  code {run['code']}", flush=True)

    medians = {name: statistics.median(r["seconds"] for r in rs if r["code"] == 0) for name, rs in runs.items()
               if any(r["code"] == 0 for r in rs)}
    reference = medians.get("torchrun textbook")
    entry = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_1min_median": statistics.median(loads)},
        "note": args.note,
        "command": TRAIN,
        "trees": dict(args.dptrain),
        "repeats": args.repeats,
        "median_seconds": {name: round(m, 3) for name, m in medians.items()},
        "against_torchrun_textbook": ({name: round(m / reference, 3) for name, m in medians.items()}
                                      if reference else {}),
        "runs": runs,
    }
    document = json.loads(args.out.read_text()) if args.out.exists() else {}
    document[args.label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    for name, m in medians.items():
        ratio = f"  {m / reference:.2f}x torchrun textbook" if reference else ""
        print(f"median {name:28s} {m:6.2f} s{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
