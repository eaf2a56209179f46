"""Sharding side by side in one run: throughput against plain FSDP2, memory against DDP, sync against allreduce.

    python benchmarks/shard_throughput.py benchmarks/results/shard_throughput.json --repeats 3   # ~3 min on 2 cores

On one model (the zoo's mlp, hidden widths `--hidden`) and one built-in data set (`--dataset`), with SGD
(`--lr`, momentum 0.9), `--batch-size` rows per rank and step, `--epochs` epochs, one torch thread per rank, gloo
on 127.0.0.1:

1. throughput: `dptrain train --shard full` (2 ranks) and `--shard hybrid --shard-size 2` (4 ranks) against
   baselines/plain_fsdp.py, a plain FSDP2 script (fully_shard on the same units, a DeviceMesh of 2, or of 2 x 2
   for HSDP) under torchrun. Samples per second of a run: the median over its epochs after the first (warm-up)
   of the epoch's training samples per second, each rank's samples over its own seconds summed over the ranks
   (as dptrain's metrics.jsonl counts them). Each repeat runs every variant once, in an order rotated from
   repeat to repeat (so the machine's noise falls on all alike), with seed = the repeat's number; the ratio is
   the median of dptrain's runs over the median of plain's (the goal: >= 0.97), with each repeat's own ratio
   (the goal is called met only when every repeat's ratio reaches it); beside them, full against unsharded DDP
   on as many ranks (what sharding costs a model that fits);
2. memory per rank: parameters + gradients + optimizer state held (this rank's shards) and peak RSS, of a
   `--memory-epochs` run through dptrain.Trainer (`dptrain run` on this file: --shard none with allreduce =
   DDP, full, hybrid), then one more backward so that the gradients exist; beside them, plain FSDP2's;
3. test accuracy at equal epochs of `--shard hybrid --strategy sync` and `--strategy async` against `--shard
   hybrid --strategy allreduce` (the throughput runs' own, one per seed).

Writes OUT (settings, the machine, every run, the summaries) and OUT with .md (the tables), and prints the tables.
Every run is a fresh process tree with a time limit (`--run-timeout`); a run that fails or times out is recorded
as failed and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "baselines" / "plain_fsdp.py"
GOAL = 0.97  # dptrain's samples/s over plain FSDP2's
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "TORCHELASTIC_RUN_ID")
MiB = 2 ** 20


@dataclass(frozen=True)
class Variant:
    """One way of training the same model: by dptrain (`dptrain train`) or by plain FSDP2 (torch alone)."""

    name: str
    ranks: int
    shard: str  # none, full or hybrid
    strategy: str = "allreduce"
    plain: bool = False

    @property
    def shard_size(self) -> int:
        """S, the ranks holding one replica."""
        return {"none": 1, "full": self.ranks, "hybrid": 2}[self.shard]

    def shard_flags(self) -> list[str]:
        flags = ["--shard", self.shard, "--strategy", self.strategy]
        return flags + (["--shard-size", "2"] if self.shard == "hybrid" else [])


VARIANTS = (Variant("dptrain full", 2, "full"), Variant("plain FSDP2 full", 2, "full", plain=True),
            Variant("dptrain hybrid", 4, "hybrid"), Variant("plain FSDP2 hybrid", 4, "hybrid", plain=True),
            Variant("dptrain hybrid sync", 4, "hybrid", "sync"), Variant("dptrain DDP", 2, "none"),
            Variant("dptrain hybrid async", 4, "hybrid", "async"))
PAIRS = (("dptrain full", "plain FSDP2 full"), ("dptrain hybrid", "plain FSDP2 hybrid"))  # against GOAL
COSTS = (("dptrain full", "dptrain DDP"),)  # what sharding costs in samples/s on as many ranks (no goal)
ACCURACY = ("dptrain hybrid sync", "dptrain hybrid async", "dptrain hybrid")  # at equal epochs
MEMORY = (Variant("dptrain DDP", 2, "none"), Variant("dptrain full", 2, "full"), Variant("dptrain hybrid", 4, "hybrid"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=HERE / "results" / "shard_throughput.json")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved (default: 3)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of each throughput run (default: 6)")
    parser.add_argument("--memory-epochs", type=int, default=1, help="epochs of each memory run (default: 1)")
    parser.add_argument("--dataset", default="digits", help="a built-in data set of dptrain (default: digits)")
    parser.add_argument("--hidden", type=widths, default=(512, 512),
                        help="the mlp's hidden widths, comma-separated (default: 512,512)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank and step (default: 32)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD's learning rate, momentum 0.9 (default: 0.02)")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds one run may take (default: 240)")
    args = parser.parse_args(argv)
    for name in ("repeats", "epochs", "memory_epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is the warm-up, left out of the throughput")
    return args


def widths(text: str) -> tuple[int, ...]:
    """'512,512' -> (512, 512); argparse's type for --hidden."""
    try:
        found = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden takes widths such as 512,512, not {text!r}") from None
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"--hidden takes positive widths such as 512,512, not {text!r}")
    return found


# ------------------------------------------------------------------------------------------ the commands


def dptrain_command(variant: Variant, args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    hidden = "[" + ",".join(map(str, args.hidden)) + "]"
    return [sys.executable, "-m", "dptrain", "train", "--workers", str(variant.ranks), "--dataset", args.dataset,
            "--model", "mlp", "--model-option", f"hidden={hidden}", "--optimizer", "sgd", "--lr", str(args.lr),
            "--momentum", "0.9", "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
            "--seed", str(seed), "--checkpoint-every", "0", "--no-progress", *variant.shard_flags(),
            "--out", str(out)]


def plain_command(variant: Variant, args: argparse.Namespace, seed: int, out: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(variant.ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(PLAIN), "--dataset", args.dataset,
            "--hidden", ",".join(map(str, args.hidden)), "--lr", str(args.lr), "--momentum", "0.9",
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--seed", str(seed),
            "--shard-size", str(variant.shard_size), "--out", str(out)]


def memory_command(variant: Variant, args: argparse.Namespace, out: Path) -> list[str]:
    spec = {"shard": variant.shard, "dataset": args.dataset, "hidden": list(args.hidden), "lr": args.lr,
            "batch_size": args.batch_size, "epochs": args.memory_epochs, "out": str(out)}
    return [sys.executable, "-m", "dptrain", "run", "--workers", str(variant.ranks), str(Path(__file__).resolve()),
            "--memory-worker", json.dumps(spec)]


def rotated(variants: Sequence[Variant], repeat: int) -> list[Variant]:
    """The variants in the order repeat `repeat` runs them: each repeat starts one further on."""
    start = repeat % len(variants)
    return list(variants[start:]) + list(variants[:start])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_bounded(command: list[str], timeout: float) -> Optional[str]:
    """Run `command` as a process group of its own, at most `timeout` s; None when it ended well, else why not
    (its exit code or the time limit, and the end of its output). A run past its time is ended, group and all."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                    output, _ = process.communicate(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    output = ""
            return f"timed out after {timeout:.0f} s: {output[-400:]}"
    return None if process.returncode == 0 else f"exit code {process.returncode}: {output[-400:]}"


# ------------------------------------------------------------------------------------------ one run each


def steady_rate(per_epoch: Sequence[float]) -> float:
    """A run's samples per second: the median over its epochs after the first (the warm-up)."""
    return statistics.median(per_epoch[1:] if len(per_epoch) > 1 else per_epoch)


def dptrain_result(run_dir: Path) -> dict:
    """Per-epoch samples/s and the last epoch's test accuracy, from a dptrain run directory's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"samples_per_second": [r["samples_per_second"] for r in records],
            "test_accuracy": records[-1].get("test_accuracy")}


def throughput_run(variant: Variant, args: argparse.Namespace, repeat: int, scratch: Path) -> dict:
    """One run of `variant` with seed `repeat`: its per-epoch samples/s, steady rate, accuracy, wall seconds."""
    where = scratch / f"{variant.name.replace(' ', '-')}-{repeat}"
    if variant.plain:
        command = plain_command(variant, args, repeat, where.with_suffix(".json"), free_port())
    else:
        command = dptrain_command(variant, args, repeat, where)
    started = time.perf_counter()
    failed = run_bounded(command, args.run_timeout)
    row = {"variant": variant.name, "repeat": repeat, "seed": repeat, "ranks": variant.ranks,
           "wall_seconds": round(time.perf_counter() - started, 2), "load_average": os.getloadavg()[0]}
    if failed is not None:
        return {**row, "failed": failed}
    result = json.loads(where.with_suffix(".json").read_text()) if variant.plain else dptrain_result(where)
    return {**row, "samples_per_second": result["samples_per_second"],
            "steady_samples_per_second": steady_rate(result["samples_per_second"]),
            "test_accuracy": result["test_accuracy"], "held": result.get("ranks")}


def memory_run(variant: Variant, args: argparse.Namespace, scratch: Path) -> list[dict]:
    """Rank by rank, what a `dptrain run` of `variant` held (or one row saying why it failed)."""
    prefix = scratch / f"memory-{variant.shard}"
    failed = run_bounded(memory_command(variant, args, prefix), args.run_timeout)
    if failed is not None:
        return [{"variant": variant.name, "failed": failed}]
    return [{"variant": variant.name, "S": variant.shard_size,
             **json.loads(Path(f"{prefix}.rank-{rank}.json").read_text())} for rank in range(variant.ranks)]


def memory_worker(spec: dict) -> None:
    """One rank of a memory run: train through dptrain.Trainer, one more backward, count what it holds; the
    numbers into OUT.rank-R.json."""
    import torch
    from torch import nn

    import dptrain
    from dptrain.data import load_dataset
    from dptrain.models import build_model

    sys.path.insert(0, str(HERE))
    from shard_memory import _resident, _trim, held_bytes

    data = load_dataset(spec["dataset"], seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_outputs, options={"hidden": spec["hidden"]})
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    shard = {"none": {}, "full": {"shard": "full"}, "hybrid": {"shard": "hybrid", "shard_size": 2}}[spec["shard"]]
    strategy = dptrain.AllReduce()
    trainer = dptrain.Trainer(model, optimizer, "cross-entropy", strategy, batch_size=spec["batch_size"],
                              verbose=False, progress=False, **shard)
    trainer.fit((data.x_train, data.y_train), epochs=spec["epochs"])
    module = strategy.model  # the user's module, sharded in place when S > 1
    # The loop frees the gradients after each step: one more backward makes them exist (DDP's buckets, a second
    # copy of them, are not counted).
    x = torch.from_numpy(data.x_train.to_numpy()[:spec["batch_size"]]).float()
    y = torch.from_numpy(data.y_train.to_numpy()[:spec["batch_size"]]).long()
    nn.functional.cross_entropy(module(x), y).backward()
    held = {**held_bytes(module, optimizer), "parameters": sum(p.numel() for p in module.parameters())}
    _trim()
    rank = int(os.environ["RANK"])
    Path(f"{spec['out']}.rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, **held, "peak_rss": _resident("VmHWM"), "rss_now": _resident("VmRSS")}))


# ------------------------------------------------------------------------------------------ the summaries


def summarise_throughput(runs: Sequence[dict]) -> dict:
    """Per variant its steady samples/s per repeat, their median and its accuracies; per pair (dptrain, plain)
    the ratio of the medians, each repeat's own ratio, and whether the ratio of the medians meets GOAL."""
    by_variant: dict[str, dict] = {}
    for run in runs:
        entry = by_variant.setdefault(run["variant"], {"ranks": run["ranks"], "rates": {}, "accuracy": {},
                                                       "failed": 0})
        if "failed" in run:
            entry["failed"] += 1
            continue
        entry["rates"][run["repeat"]] = run["steady_samples_per_second"]
        entry["accuracy"][run["repeat"]] = run["test_accuracy"]
    for entry in by_variant.values():
        entry["median"] = statistics.median(entry["rates"].values()) if entry["rates"] else None
        accuracies = [a for a in entry["accuracy"].values() if a is not None]
        entry["median_accuracy"] = statistics.median(accuracies) if accuracies else None
    pairs = {}
    for (mine, other), goal in [(pair, GOAL) for pair in PAIRS] + [(pair, None) for pair in COSTS]:
        if mine not in by_variant or other not in by_variant:
            continue
        a, b = by_variant[mine], by_variant[other]
        ratio = a["median"] / b["median"] if a["median"] and b["median"] else None
        paired = [a["rates"][r] / b["rates"][r] for r in sorted(a["rates"]) if r in b["rates"]]
        pairs[f"{mine} / {other}"] = {"ratio": ratio, "per_repeat": paired, "goal": goal,
                                      "verdict": verdict(paired, goal)}
    return {"variants": by_variant, "ratios": pairs}


def verdict(paired: Sequence[float], goal: Optional[float]) -> str:
    """'met' when every repeat's ratio reaches `goal`, 'not met' when none does, else 'not shown' (the repeats
    fall on both sides: the noise is larger than the difference); '' without a goal."""
    if goal is None:
        return ""
    if not paired:
        return "not measured"
    if min(paired) >= goal:
        return "met"
    return "not met" if max(paired) < goal else "not shown"


def summarise_memory(rows: Sequence[dict]) -> list[dict]:
    """Per run the largest rank's held bytes (params + grads + optimizer state) and peak RSS, and both against
    the unsharded DDP run's (`vs_ddp`: held, peak RSS)."""
    out: list[dict] = []
    for name in dict.fromkeys(row["variant"] for row in rows):
        ranks = [row for row in rows if row["variant"] == name and "failed" not in row]
        if not ranks:
            out.append({"variant": name, "failed": True})
            continue
        held = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
        top = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        out.append({"variant": name, "S": ranks[0].get("S"), "ranks": len(ranks), "params": top["params"],
                    "grads": top["grads"], "optimizer": top["optimizer"], "held": held,
                    "peak_rss": max(r["peak_rss"] for r in ranks)})
    ddp = next((row for row in out if row["variant"] == "dptrain DDP" and "held" in row), None)
    for row in out:
        if ddp is not None and "held" in row:
            row["vs_ddp"] = [row["held"] / ddp["held"], row["peak_rss"] / ddp["peak_rss"]]
    return out


def plain_memory_rows(runs: Sequence[dict]) -> list[dict]:
    """Rank by rank, what plain FSDP2 held in its first repeat's runs (rows as memory_run's)."""
    return [{"variant": run["variant"], "S": 2, "rank": rank, **held} for run in runs
            if run["variant"].startswith("plain") and run["repeat"] == 0
            for rank, held in enumerate(run.get("held") or [])]


def _number(value: Optional[float], digits: int = 0) -> str:
    return "failed" if value is None else f"{value:,.{digits}f}"


def tables(throughput: dict, memory: Sequence[dict]) -> str:
    """The three tables, in markdown."""
    lines = ["| variant | ranks | samples/s per repeat | median samples/s | failed runs |", "|---|--:|---|--:|--:|"]
    for name, entry in throughput["variants"].items():
        rates = ", ".join(_number(entry["rates"][r]) for r in sorted(entry["rates"])) or "none"
        lines.append(f"| {name} | {entry['ranks']} | {rates} | {_number(entry['median'])} | {entry['failed']} |")
    lines += ["", "| ratio of samples/s | ratio of the medians | each repeat's ratio | goal | every repeat |",
              "|---|--:|---|--:|:--:|"]
    for name, pair in throughput["ratios"].items():
        each = ", ".join(f"{r:.2f}" for r in pair["per_repeat"])
        goal = f">= {pair['goal']}" if pair["goal"] is not None else ""
        lines.append(f"| {name} | {_number(pair['ratio'], 2)} | {each} | {goal} | {pair['verdict']} |")
    lines += ["", "| run | S | params MiB | grads MiB | optimizer MiB | held MiB | held vs DDP | peak RSS MiB | "
              "peak RSS vs DDP |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in memory:
        if row.get("failed"):
            lines.append(f"| {row['variant']} | | | | | failed | | | |")
            continue
        held, rss = row.get("vs_ddp", (None, None))
        lines.append(f"| {row['variant']} | {row['S']} | {row['params'] / MiB:.2f} | {row['grads'] / MiB:.2f} | "
                     f"{row['optimizer'] / MiB:.2f} | {row['held'] / MiB:.2f} | {_number(held, 2)} | "
                     f"{row['peak_rss'] / MiB:.0f} | {_number(rss, 2)} |")
    lines += ["", "| test accuracy at equal epochs | per seed | median |", "|---|---|--:|"]
    for name in ACCURACY:
        entry = throughput["variants"].get(name)
        if entry is not None:
            each = ", ".join(f"{entry['accuracy'][r]:.4f}" for r in sorted(entry["accuracy"]))
            lines.append(f"| {name} | {each} | {_number(entry['median_accuracy'], 4)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the whole run


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(args: argparse.Namespace) -> None:
    before = machine()
    runs: list[dict] = []
    memory_rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shard-throughput-") as scratch:
        for repeat in range(args.repeats):
            for variant in rotated(VARIANTS, repeat):
                runs.append(throughput_run(variant, args, repeat, Path(scratch)))
                print(f"{variant.name} (seed {repeat}): " + (runs[-1].get("failed") or
                      f"{runs[-1]['steady_samples_per_second']:,.0f} samples/s, test accuracy "
                      f"{runs[-1]['test_accuracy']:.4f}"), flush=True)
        for variant in MEMORY:
            memory_rows += memory_run(variant, args, Path(scratch))
    throughput = summarise_throughput(runs)
    memory = summarise_memory(memory_rows + plain_memory_rows(runs))
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    record = {"settings": settings, "machine_before": before, "machine_after": machine(), "runs": runs,
              "memory_runs": memory_rows, "throughput": throughput, "memory": memory}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    text = tables(throughput, memory)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory-worker"]:
        memory_worker(json.loads(sys.argv[2]))
    else:
        main(parse_args())
