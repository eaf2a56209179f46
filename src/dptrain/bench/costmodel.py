"""The alpha-beta cost model: time per epoch of each strategy on N workers, calibrated from measured runs.

All pure functions. A message of b bytes costs `latency + b / bandwidth` (alpha + b·beta).
A strategy is timed by the communication pattern its registry entry names (COMMUNICATION):

- step-allreduce (allreduce): one ring all-reduce of the gradients per step,
  2(N-1)/N · M/B + 2(N-1)·alpha, with no overlap of communication and computation assumed;
- periodic-allreduce (sync; fedavg, one weighted average per round): one ring all-reduce of
  the weights every `every` epochs;
- merge-service (async): each worker sends its delta and receives the global model once per
  epoch (2 messages of M bytes), and every merge passes through one service, so per epoch the
  service handles N-1 remote merges in sequence: the epoch takes the longer of a worker's own
  time and the service's.

Compute is `seconds_per_sample` times the samples of one worker's shard (ceil(S/N)), so a
projection to many workers shrinks each worker's share of a fixed data set (strong scaling).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

from dptrain import registry

STRATEGIES = registry.names("strategy")
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Calibration:
    """What the model needs to know about the job and the machine."""

    seconds_per_sample: float  # forward + backward + optimizer step, per sample, on one worker
    model_bytes: int  # one copy of the parameters (the payload of one all-reduce)
    bandwidth: float  # bytes per second of one worker's link
    latency: float  # alpha: seconds per message
    samples: int  # training samples per epoch (all workers together)
    batch_size: int  # per worker

    def as_dict(self) -> dict:
        return asdict(self)


def ring_allreduce_seconds(workers: int, payload_bytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `payload_bytes` over `workers`: 2(N-1)/N · M/B + 2(N-1)·alpha."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * payload_bytes / bandwidth + 2 * (workers - 1) * latency


def shard_samples(samples: int, workers: int) -> int:
    return math.ceil(samples / workers)


def steps_per_epoch(samples: int, workers: int, batch_size: int) -> int:
    return max(1, math.ceil(shard_samples(samples, workers) / batch_size))


def _step_allreduce(workers: int, cal: Calibration, every: int, compute: float) -> float:
    """One ring all-reduce of the gradients per step (`every` does not apply)."""
    steps = steps_per_epoch(cal.samples, workers, cal.batch_size)
    return steps * ring_allreduce_seconds(workers, cal.model_bytes, cal.bandwidth, cal.latency)


def _periodic_allreduce(workers: int, cal: Calibration, every: int, compute: float) -> float:
    """One ring all-reduce of the weights every `every` epochs."""
    return ring_allreduce_seconds(workers, cal.model_bytes, cal.bandwidth, cal.latency) / every


def _merge_service(workers: int, cal: Calibration, every: int, compute: float) -> float:
    """The worker's own round trip to the merge service, unless the one service is the bottleneck."""
    message = cal.latency + cal.model_bytes / cal.bandwidth
    own = 2 * message / every
    service = (workers - 1) * 2 * message / every
    return max(own, service - compute)


# Seconds of communication per epoch, by the `communication` a strategy's registry entry names.
COMMUNICATION = {
    "step-allreduce": _step_allreduce,
    "periodic-allreduce": _periodic_allreduce,
    "merge-service": _merge_service,
}


def epoch_seconds(strategy: str, workers: int, cal: Calibration, every: int = 1) -> dict:
    """{'compute', 'communication', 'total'} seconds of one epoch of `strategy` on `workers`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    compute = shard_samples(cal.samples, workers) * cal.seconds_per_sample
    communicate = COMMUNICATION[registry.STRATEGIES[strategy].communication]
    communication = 0.0 if workers <= 1 else communicate(workers, cal, every, compute)
    return {"compute": compute, "communication": communication, "total": compute + communication}


def project(strategies: Iterable[str], workers: Iterable[int], cal: Calibration, every: int = 1) -> list[dict]:
    """One row per (strategy, N): epoch time, its parts, speedup and efficiency against 1 worker."""
    rows = []
    for strategy in strategies:
        alone = epoch_seconds(strategy, 1, cal, every)["total"]
        for n in workers:
            times = epoch_seconds(strategy, n, cal, every)
            speedup = alone / times["total"]
            rows.append({"strategy": strategy, "workers": n, "steps_per_epoch": steps_per_epoch(cal.samples, n, cal.batch_size),
                         "compute_seconds": times["compute"], "communication_seconds": times["communication"],
                         "epoch_seconds": times["total"], "speedup": speedup, "efficiency": speedup / n})
    return rows


def powers_of_two(up_to: int) -> list[int]:
    return [2 ** k for k in range(int(math.log2(up_to)) + 1)]


# -- calibration from measured runs -----------------------------------------------------------

def calibrate(runs: list[dict], network: Optional[dict] = None, bandwidth: Optional[float] = None,
              latency: Optional[float] = None) -> Calibration:
    """A Calibration from `dptrain bench` result rows (results.json 'runs').

    Compute per sample comes from the runs that communicate least (sync, else 1 worker) at the
    largest worker count measured, minus the model's estimate of their communication, so it
    reflects how fast one worker computes when the machine holds that many. Bandwidth and
    latency come from the link probe of an emulated network unless given.
    """
    measured = [run for run in runs if run.get("kind", "dptrain") == "dptrain" and run.get("epoch_seconds")]
    if not measured:
        raise ValueError("no dptrain runs with epoch times to calibrate from")
    if bandwidth is None:
        if not network or not network.get("bandwidth_bytes_per_second"):
            raise ValueError("no measured bandwidth: give one, or calibrate from a run with an emulated network")
        bandwidth = network["bandwidth_bytes_per_second"]
    if latency is None:
        latency = network["round_trip_seconds"] / 2 if network and network.get("round_trip_seconds") else 0.0
    quiet = [run for run in measured if run["strategy"] == "sync"] or [run for run in measured if run["workers"] == 1]
    widest = max(run["workers"] for run in quiet)
    quiet = [run for run in quiet if run["workers"] == widest]
    first = quiet[0]
    base = Calibration(seconds_per_sample=0.0, model_bytes=FLOAT32_BYTES * first["model_parameters"],
                       bandwidth=bandwidth, latency=latency, samples=first["train_samples"], batch_size=first["batch_size"])
    per_sample = []
    for run in quiet:
        comm = epoch_seconds("sync", run["workers"], base)["communication"]
        per_sample.append(max(run["epoch_seconds"] - comm, 0.0) / shard_samples(run["train_samples"], run["workers"]))
    return Calibration(seconds_per_sample=statistics.median(per_sample), model_bytes=base.model_bytes,
                       bandwidth=bandwidth, latency=latency, samples=base.samples, batch_size=base.batch_size)


def validate(runs: list[dict], cal: Calibration) -> list[dict]:
    """Predicted against measured epoch time for each (strategy, workers) measured, averaged over repeats."""
    groups: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        if run.get("kind", "dptrain") == "dptrain" and run.get("epoch_seconds") and run["strategy"] in STRATEGIES:
            groups.setdefault((run["strategy"], run["workers"]), []).append(run["epoch_seconds"])
    rows = []
    for (strategy, workers), times in sorted(groups.items()):
        measured = statistics.mean(times)
        predicted = epoch_seconds(strategy, workers, cal)["total"]
        rows.append({"strategy": strategy, "workers": workers, "measured_epoch_seconds": measured,
                     "predicted_epoch_seconds": predicted, "error": (predicted - measured) / measured})
    return rows
