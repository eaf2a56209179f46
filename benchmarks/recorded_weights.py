"""Record (or check) the SHA-256 of model.pt for fixed settings, so a restructuring can show it changed no result.

    python benchmarks/recorded_weights.py record benchmarks/results/recorded_weights.json
    python benchmarks/recorded_weights.py check  benchmarks/results/recorded_weights.json

Each case trains digits on 2 local workers (1 for `single`) for 3 epochs. Hashes are of the
final state_dict's tensors (names, dtypes, shapes, bytes), not of the pickle, so they compare
weights only. They hold on one kind of machine (the same CPU kernels); async is left out
because its merge order varies from run to run.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
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


def weights_hash(path: Path) -> str:
    state = torch.load(path, weights_only=True)
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def run_all() -> dict[str, str]:
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in CASES.items():
            out = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "dptrain", "train", *COMMON, *args, "--out", str(out)],
                           check=True, stdout=subprocess.DEVNULL)
            hashes[name] = weights_hash(out / "model.pt")
            print(f"{name:28s} {hashes[name][:16]}", flush=True)
    return hashes


def main() -> int:
    mode, path = sys.argv[1], Path(sys.argv[2])
    hashes = run_all()
    if mode == "record":
        path.write_text(json.dumps(hashes, indent=2) + "\n")
        return 0
    recorded = json.loads(path.read_text())
    differ = [name for name in recorded if recorded[name] != hashes.get(name)]
    print("all weights identical to the record" if not differ else f"weights differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
