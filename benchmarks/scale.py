"""Large worlds on one machine: 8 to 128 ranks of a tiny model under every strategy, checked exactly and measured.

    python benchmarks/scale.py benchmarks/results/scale --worlds 8 16 32 64 128

For each world size W, one `dptrain run --workers W benchmarks/scale_worker.py` (the real spawner,
rendezvous store, heartbeats; gloo, oversubscribed: W ranks on this machine's cores) trains one epoch
of allreduce, sync, async and fedavg in turn, in the same processes. From the ranks' records it checks
what must hold at any size (`check`):

* no sample lost or duplicated: the rows the ranks trained on are every row exactly once;
* allreduce: the final model is the replay of the steps with each step's gradients averaged over the
  ranks (what DDP computes), from the rows each rank recorded;
* sync: the final model is the mean of the replicas; async (one merge each): the mean of the merged
  models, with one merge per rank; fedavg: the mean weighted by each client's partition size, which
  is the number of rows it trained on;
* every rank ends with the same model, and comm_bytes is exactly what each strategy hands over;

and measures start-up (launch to the first training step of the slowest rank), peak RSS per rank
(which counts torch's shared libraries in every rank) and PSS (which shares them out: the sum over
the ranks is the world's memory), the lowest MemAvailable during the run, descriptors and threads,
the heartbeats' store round trips, the store's keys, the wall time and the load average before the
run (the machine may be shared). Before each world it estimates the memory that world needs from the
memory of the last one measured (each rank's private memory, the shared libraries once) and skips it, saying so, if the machine does not have it: an OOM kill
could hit someone else's process.

Writes OUT/scale.json (one entry per world) and OUT/scale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale_worker as worker  # noqa: E402

from dptrain.strategies.asynchronous import flat_state  # noqa: E402

HEADER = 4 * 8  # an async exchange's header and reply: four int64 each
TOLERANCE = 1e-5  # float32 sums of up to 128 terms in another order


def available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 1024


def replay_allreduce(records: list[dict], world: int) -> torch.Tensor:
    """The model after each step's gradients, averaged over the ranks, were applied (plain SGD)."""
    x, y = (torch.from_numpy(a) for a in worker.data(world))
    net = worker.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=worker.LR)
    runs = [r["strategies"]["allreduce"] for r in records]
    for step in range(len(runs[0]["step_ends"])):
        optimizer.zero_grad()
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for run in runs:
            begin = run["step_ends"][step - 1] if step else 0
            rows = torch.tensor(run["read"][begin:run["step_ends"][step]])
            net.zero_grad()
            nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
            for grad, p in zip(grads, net.parameters()):
                grad += p.grad
        for grad, p in zip(grads, net.parameters()):
            p.grad = grad / world
        optimizer.step()
    return flat_state(net)


def check(records: list[dict], world: int) -> dict:
    """The exact properties of each strategy at this world size (AssertionError naming the first that fails);
    returns per strategy the largest distance from the expected model."""
    model_bytes = sum(p.numel() for p in worker.model().parameters()) * 4
    n = worker.samples(world)
    distances = {}
    for name in records[0]["strategies"]:
        runs = [r["strategies"][name] for r in records]
        rows = sorted(i for run in runs for i in run["read"])
        assert rows == list(range(n)), f"{name}: the rows trained on are not each of the {n} rows exactly once " \
                                       f"({len(rows)} read, {len(set(rows))} distinct)"
        final = runs[0]["final"]
        assert all(torch.equal(run["final"], final) for run in runs), f"{name}: the ranks end with different models"
        replicas = torch.stack([run["replica"] for run in runs]) if name != "allreduce" else None
        steps = len(runs[0]["step_ends"])
        if name == "allreduce":
            expected = replay_allreduce(records, world)
            sent = [model_bytes * (1 + steps)] * world
        elif name == "sync":
            expected = replicas.mean(dim=0)
            sent = [2 * model_bytes] * world
        elif name == "async":
            expected = replicas.mean(dim=0)
            merges = runs[0]["summary"]["merges"]
            assert merges == [1] * world, f"async: merges per rank {merges}, not one each"
            # rank 0: the first and last broadcast; the others also one merge (header, delta, reply, global)
            # and their DONE exchange (header, reply)
            sent = [2 * model_bytes] + [4 * model_bytes + 4 * HEADER] * (world - 1)
        else:
            sizes = torch.tensor([float(run["partition_size"]) for run in runs])
            assert [len(run["read"]) for run in runs] == sizes.int().tolist(), "fedavg: a client did not train on " \
                                                                             "exactly its partition"
            assert len(set(sizes.tolist())) > 1, "fedavg: equal partitions would not test the weighting"
            expected = (sizes[:, None] * replicas).sum(dim=0) / sizes.sum()
            sent = [2 * model_bytes + 8] * world  # broadcast, one round: the total weight (float64) and the model
        if replicas is not None:
            assert not torch.allclose(replicas[0], replicas[1]), f"{name}: the replicas did not differ"
        distance = float((final - expected).abs().max())
        assert distance <= TOLERANCE, f"{name}: the final model is {distance:.2e} from the expected one"
        got = [run["comm_bytes"] for run in runs]
        assert got == sent, f"{name}: comm_bytes {got[:3]}... not {sent[:3]}..."
        distances[name] = distance
    return distances


def measure(records: list[dict], launched: float, ended: float, lowest_available: float) -> dict:
    first_steps = [r["first_step"] - launched for r in records]
    rss = [r["peak_rss_mb"] for r in records]
    pss = [r["pss_mb"] for r in records]
    heartbeat_threads = sum(1 for r in records for name in r["python_threads"] if name.startswith("dptrain-heartbeat"))
    return {
        "startup_s": round(max(first_steps), 2),  # launch to the slowest rank's first step (a step needs all)
        "import_s_median": round(sorted(r["imported"] - r["started"] for r in records)[len(records) // 2], 2),
        "joined_s": round(max(r["joined"] for r in records) - launched, 2),
        "wall_s": round(ended - launched, 2),
        "cpu_s_total": round(sum(r["cpu_s"] for r in records), 1),  # all ranks; two cores give 2 CPU-s a second
        "strategy_s": {name: round(records[0]["strategies"][name]["seconds"], 2) for name in records[0]["strategies"]},
        "peak_rss_mb_per_rank": {"max": round(max(rss), 1), "mean": round(sum(rss) / len(rss), 1)},
        "peak_rss_mb_total": round(sum(rss)),
        "pss_mb_per_rank_at_end": {"max": round(max(pss), 1), "mean": round(sum(pss) / len(pss), 1)},
        "pss_mb_total": round(sum(pss)),
        "private_mb_per_rank": round(sum(r["private_mb"] for r in records) / len(records), 1),
        "shared_mb": round(max(r["rss_mb"] - r["private_mb"] for r in records), 1),
        "lowest_available_mb": round(lowest_available),
        "descriptors": {"rank0": records[0]["descriptors"], "other_max": max(r["descriptors"] for r in records[1:])},
        "os_threads": {"rank0": records[0]["os_threads"], "other_max": max(r["os_threads"] for r in records[1:])},
        "heartbeat_threads_per_rank": heartbeat_threads / len(records),
        "store_keys": records[0]["store_keys"],
        "heartbeat_calls": sum(r["beats"] for r in records),
        "heartbeat_calls_per_s": round(sum(r["beats"] for r in records) / (ended - launched), 1),
        "slowest_heartbeat_s": round(max(r["slowest_beat_s"] for r in records), 4),
    }


def run_world(world: int, src: Path, timeout: float) -> dict:
    """One `dptrain run --workers world` of the worker; its records checked and measured."""
    out = Path(tempfile.mkdtemp(prefix=f"dptrain-scale-{world}-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    command = [sys.executable, "-m", "dptrain", "run", "--workers", str(world), "--timeout", str(timeout),
               str(HERE / "scale_worker.py"), str(out)]
    load = [round(value, 1) for value in os.getloadavg()]
    lowest = [available_mb()]
    done = threading.Event()

    def watch_memory():
        while not done.wait(0.2):
            lowest[0] = min(lowest[0], available_mb())

    watcher = threading.Thread(target=watch_memory, daemon=True)
    watcher.start()
    launched = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if "scale:" in line:
            print(f"  {line.split('scale: ', 1)[1].rstrip()} ({time.time() - launched:.0f} s since launch)", flush=True)
    code = proc.wait()
    ended = time.time()
    done.set()
    watcher.join()
    try:
        if code != 0:
            return {"world": world, "completed": False, "code": code, "wall_s": round(ended - launched, 1),
                    "load_before": load, "lowest_available_mb": round(lowest[0]), "output_tail": tail}
        records = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
        result = {"world": world, "completed": True, "load_before": load,
                  **measure(records, launched, ended, lowest[0])}
        try:
            result["max_distance_from_expected"] = check(records, world)
            result["checks"] = "passed"
        except AssertionError as exc:
            result["checks"] = f"FAILED: {exc}"
        return result
    finally:
        shutil.rmtree(out, ignore_errors=True)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.get("completed")]
    worlds = [r["world"] for r in done]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(worlds, [r["startup_s"] for r in done], "o-", label="launch to first step")
    axes[0].plot(worlds, [r["wall_s"] for r in done], "s-", label="whole run (4 strategies)")
    axes[0].plot(worlds, [r["cpu_s_total"] / 2 for r in done], "^--", label="all ranks' CPU seconds / 2 cores")
    axes[0].set_ylabel("seconds")
    axes[1].plot(worlds, [r["peak_rss_mb_per_rank"]["max"] for r in done], "o-", label="peak RSS per rank (max)")
    axes[1].plot(worlds, [r["pss_mb_per_rank_at_end"]["mean"] for r in done], "s-", label="PSS per rank (mean)")
    axes[1].set_ylabel("MiB")
    axes[2].plot(worlds, [r["pss_mb_total"] / 1024 for r in done], "o-", label="sum of the ranks' PSS")
    axes[2].plot(worlds, [r["peak_rss_mb_total"] / 1024 for r in done], "s--", label="sum of peak RSS")
    axes[2].set_ylabel("GiB")
    for axis, title in zip(axes, ("time", "memory per rank", "memory of the whole world")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(worlds, [str(w) for w in worlds])
        axis.set_xlabel("ranks (W)")
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("dptrain on one 2-core machine: W ranks of a tiny model, gloo, every strategy")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for scale.json and scale.png")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--src", type=Path, default=HERE.parent / "src", help="dptrain's source tree")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a world may take")
    parser.add_argument("--headroom-mb", type=float, default=2048.0,
                        help="memory to leave free for the machine's other users when deciding to run a world")
    parser.add_argument("--replot", action="store_true", help="only draw OUT/scale.png again from OUT/scale.json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((args.out / "scale.json").read_text())["results"], args.out / "scale.png")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    per_rank_mb = shared_mb = None
    for index, world in enumerate(args.worlds, 1):
        need = per_rank_mb * world + shared_mb if per_rank_mb else None
        free = available_mb()
        if need is not None and need > free - args.headroom_mb:
            print(f"[{index}/{len(args.worlds)}] W={world}: skipped: it needs about {need / 1024:.1f} GiB "
                  f"({per_rank_mb:.0f} MiB private per rank + {shared_mb:.0f} MiB shared, as at W={results[-1]['world']}), "
                  f"{free / 1024:.1f} GiB available, {args.headroom_mb / 1024:.1f} GiB kept free", flush=True)
            results.append({"world": world, "completed": False, "skipped": "memory", "estimated_mb": round(need),
                            "available_mb": round(free)})
            continue
        print(f"[{index}/{len(args.worlds)}] W={world}: launching {world} ranks", flush=True)
        result = run_world(world, args.src, args.timeout)
        results.append(result)
        if result.get("completed"):
            per_rank_mb, shared_mb = result["private_mb_per_rank"], result["shared_mb"]
            print(f"[{index}/{len(args.worlds)}] W={world}: start-up {result['startup_s']} s, wall {result['wall_s']} s, "
                  f"peak RSS/rank {result['peak_rss_mb_per_rank']['max']} MiB, machine "
                  f"PSS of the world {result['pss_mb_total'] / 1024:.1f} GiB, checks {result['checks']}", flush=True)
        else:
            print(f"[{index}/{len(args.worlds)}] W={world}: {result.get('checks') or 'failed'}: "
                  f"{json.dumps(result)[:400]}", flush=True)
        (args.out / "scale.json").write_text(json.dumps({
            "machine": {"cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE")
                                                                     * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                        "python": platform.python_version(), "torch": torch.__version__},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "results": results}, indent=1) + "\n")
    plot(results, args.out / "scale.png")


if __name__ == "__main__":
    main()
