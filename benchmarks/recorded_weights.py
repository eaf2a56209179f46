"""Record (or check) the SHA-256 of model.pt for fixed settings, so a restructuring can show it changed no result.

    python benchmarks/recorded_weights.py record benchmarks/results/recorded_weights.json
    python benchmarks/recorded_weights.py check  benchmarks/results/recorded_weights.json

Each case trains digits on 2 local workers (1 for `single`) for 3 epochs. Hashes are of the
final state_dict's tensors (names, dtypes, shapes, bytes), not of the pickle, so they compare
weights only. They hold on one kind of machine (the same CPU kernels); async is left out
because its merge order varies from run to run.

The elastic cases (live membership, --min-workers) train 3 workers and lose or let go of one at a fixed
point (DPTRAIN_FAULT, src/dptrain/faults.py): killed halfway through epoch 2 (sync), after its 40th step
(allreduce, and allreduce going on from its commits every 5 steps), or asked to leave by SIGUSR1 (sync). Their
record is the weights' hash too, and the membership changes with the rows each epoch read. A joiner enters at
an epoch end that depends on timing, so its record holds what does not: that it joined, once, and that every
epoch read each training row once (1,437 rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMON = ["--dataset", "digits", "--epochs", "3", "--batch-size", "32", "--lr", "0.05", "--seed", "0",
          "--no-progress"]
CASES = {
    "single": ["--workers", "1"],
    "allreduce": ["--strategy", "allreduce", "--workers", "2"],
    # --lr-scaling none: the settings as recorded before the LR scaling default (the old behaviour, by flag).
    "sync": ["--strategy", "sync", "--workers", "2", "--lr-scaling", "none"],
    "local-sgd-outer-nesterov": ["--strategy", "sync", "--workers", "2", "--sync-every-steps", "5",
                                 "--outer", "nesterov", "--lr-scaling", "none"],
    "fedavg-dirichlet": ["--strategy", "fedavg", "--workers", "2", "--partition", "dirichlet", "--alpha", "0.5"],
    "cnn-sync-adam": ["--strategy", "sync", "--workers", "2", "--model", "cnn", "--optimizer", "adam",
                      "--lr", "0.001", "--lr-schedule", "cosine", "--warmup-epochs", "1", "--lr-scaling", "none"],
    "sync-default": ["--strategy", "sync", "--workers", "2"],
}
LIVE = ["--workers", "3", "--min-workers", "2", "--timeout", "60"]
ELASTIC = {  # name: (arguments, DPTRAIN_FAULT, DPTRAIN_FAULT_ACTION)
    "elastic-sync-kill": (["--strategy", "sync", *LIVE], "train-middle@1:2", None),
    "elastic-allreduce-kill": (["--strategy", "allreduce", *LIVE], "step@1:40", None),
    "elastic-allreduce-commit": (["--strategy", "allreduce", *LIVE, "--commit-every-steps", "5"], "step@1:40", None),
    "elastic-sync-leave": (["--strategy", "sync", *LIVE], "train-middle@2:2", "stop"),
}
TRAIN_ROWS = 1437


def weights_hash(path: Path) -> str:
    state = torch.load(path, weights_only=True)
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def membership(out: Path) -> list:
    """Each epoch's record of metrics.jsonl as (epoch, rows read, the membership change noted with it)."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        change = record.get("membership")
        change = {key: change[key] for key in ("members", "left", "joined") if key in change} if change else None
        rows.append([record["epoch"], sum(worker["samples"] for worker in record["workers"]), change])
    return rows


def elastic(name: str, args: list, fault: str, action, tmp: Path) -> str:
    out = tmp / name
    env = {**os.environ, "DPTRAIN_FAULT": fault}
    if action:
        env["DPTRAIN_FAULT_ACTION"] = action
    subprocess.run([sys.executable, "-m", "dptrain", "train", *COMMON, *args, "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return weights_hash(out / "model.pt") + " " + json.dumps(membership(out))


def joiner(tmp: Path) -> str:
    """sync on 2 workers (--min-workers 1 --max-workers 3), rank 1 slowed; `dptrain join` once the run is up."""
    out = tmp / "elastic-join"
    run = subprocess.Popen([sys.executable, "-m", "dptrain", "train", *COMMON[:2], "--epochs", "5", *COMMON[4:],
                            "--strategy", "sync", "--workers", "2", "--min-workers", "1", "--max-workers", "3",
                            "--slow-worker", "1:40", "--timeout", "60", "--out", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (out / "join.address").exists() and run.poll() is None:
        time.sleep(0.1)
    join = subprocess.run([sys.executable, "-m", "dptrain", "join", str(out)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=600)
    if run.wait(timeout=600) or join.returncode:
        raise SystemExit(f"elastic-join: the run exited {run.returncode}, the joiner {join.returncode}")
    rows = membership(out)
    joined = [change["joined"] for _, _, change in rows if change and change.get("joined")]
    every_row_once = all(samples == TRAIN_ROWS for _, samples, _ in rows)
    return json.dumps({"joined": joined, "epochs": len(rows), "every_epoch_read_each_row_once": every_row_once})


def run_all(names: list[str]) -> dict[str, str]:
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in CASES.items():
            if names and name not in names:
                continue
            out = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "dptrain", "train", *COMMON, *args, "--out", str(out)],
                           check=True, stdout=subprocess.DEVNULL)
            hashes[name] = weights_hash(out / "model.pt")
            print(f"{name:28s} {hashes[name][:16]}", flush=True)
        for name, (args, fault, action) in ELASTIC.items():
            if names and name not in names:
                continue
            hashes[name] = elastic(name, args, fault, action, Path(tmp))
            print(f"{name:28s} {hashes[name][:16]} {hashes[name][65:]}", flush=True)
        if not names or "elastic-join" in names:
            hashes["elastic-join"] = joiner(Path(tmp))
            print(f"{'elastic-join':28s} {hashes['elastic-join']}", flush=True)
    return hashes


def main() -> int:
    mode, path, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]  # names: only those cases
    hashes = run_all(names)
    if mode == "record":
        recorded = json.loads(path.read_text()) if names and path.exists() else {}
        path.write_text(json.dumps({**recorded, **hashes}, indent=2) + "\n")
        return 0
    recorded = json.loads(path.read_text())
    differ = [name for name in recorded if (not names or name in names) and recorded[name] != hashes.get(name)]
    print("all weights identical to the record" if not differ else f"weights differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
