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

Modes beyond the plain strategies, chosen by `Settings` (their defaults give the plain results):

- compression (`--compression fp16|bf16|int8`): an average sends the compressed change instead
  of float32 weights: fp16/bf16 2 bytes an element; int8 1 byte an element plus one float32
  scale per block of INT8_BLOCK elements. A compressed average is the two-step mean
  (dptrain.strategies.compression): an all_to_all of the payload's N chunks, (N-1)/N·payload/B +
  (N-1)·alpha, then a ring all_gather of the encoded mean chunks, (N-1)·payload/N/B + (N-1)·alpha:
  2(N-1)/N·payload/B + 2(N-1)·alpha in all, the ring all-reduce's cost at the compressed size
  (int8 about 1/4, fp16/bf16 1/2 of float32's at every N; the former all_gather of every payload,
  (N-1)·payload, is `all_gather_seconds`). The weights' all_gather (fedavg, 8 bytes) and the
  padding of uneven chunks (under one block a rank) are left out. The per-step gradient all-reduce
  with fp16/bf16 is DDP's compression hook, a ring all-reduce of 2-byte elements; int8 gradients
  (which the allreduce strategy refuses) are priced as the two-step mean. Async merges are not
  compressed.
- overlapped averaging (overlapped-average; strategy streaming): an average of the weights starts
  in the background and is applied `delay_steps` steps later (default: half the period rounded
  up, as streaming's --overlap-steps), so it hides behind the compute of min(delay, period)
  steps: time per period = compute of the period + max(0, transfer - compute hidden) +
  apply_seconds; with delay >= period that is max(compute, transfer) + apply. With `fragments`
  F a period sends 1/F of the model. (Streaming drains an average still in flight at an epoch
  end; that loss of cover near epoch ends is not modelled.)
- hierarchical sync (hierarchical-allreduce; strategy hierarchical): N ranks on N/G nodes of G
  ranks; per step a ring all-reduce of the gradients among a node's G ranks over the fast
  intra-node link (node_bandwidth, node_latency), and per period an average among the N/G node
  leaders over the slow link (bandwidth, latency), which each leader then broadcasts to its node
  (M/node_bandwidth + node_latency).
- auto (`--strategy auto`): the candidate it would pick (its candidates and the rule are here, below
  the strategy, dptrain.strategies.auto, which measures and then picks by them).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

from dptrain import registry

STRATEGIES = registry.names("strategy")
FLOAT32_BYTES = 4
COMPRESSIONS = ("none", "fp16", "bf16", "int8")
ELEMENT_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}
INT8_BLOCK = 256  # elements that share one float32 scale in int8 compression


@dataclass(frozen=True)
class Calibration:
    """What the model needs to know about the job and the machine."""

    seconds_per_sample: float  # forward + backward + optimizer step, per sample, on one worker
    model_bytes: int  # one copy of the parameters (the payload of one all-reduce)
    bandwidth: float  # bytes per second of one worker's link
    latency: float  # alpha: seconds per message
    samples: int  # training samples per epoch (all workers together)
    batch_size: int  # per worker
    apply_seconds: float = 0.0  # overlapped averaging: applying one finished average
    node_bandwidth: Optional[float] = None  # hierarchical: bytes per second inside a node (None: as `bandwidth`)
    node_latency: float = 0.0  # hierarchical: alpha inside a node

    def as_dict(self) -> dict:
        return asdict(self)


def ring_allreduce_seconds(workers: int, payload_bytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `payload_bytes` over `workers`: 2(N-1)/N · M/B + 2(N-1)·alpha."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * payload_bytes / bandwidth + 2 * (workers - 1) * latency


def compressed_bytes(elements: int, compression: str = "none") -> int:
    """Payload of `elements` float32 values after compression: 4, 2 (fp16, bf16) or 1 byte each, int8
    plus one float32 scale per block of INT8_BLOCK elements."""
    if compression not in ELEMENT_BYTES:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    scales = math.ceil(elements / INT8_BLOCK) * FLOAT32_BYTES if compression == "int8" else 0
    return elements * ELEMENT_BYTES[compression] + scales


def all_gather_seconds(workers: int, payload_bytes: float, bandwidth: float, latency: float) -> float:
    """Ring all_gather of `payload_bytes` from every rank: each sends (N-1)·payload, (N-1)·payload/B + (N-1)·alpha."""
    if workers <= 1:
        return 0.0
    return (workers - 1) * payload_bytes / bandwidth + (workers - 1) * latency


def all_to_all_seconds(workers: int, payload_bytes: float, bandwidth: float, latency: float) -> float:
    """All_to_all of `payload_bytes` from every rank in N equal parts: each sends N-1 of them,
    (N-1)/N·payload/B + (N-1)·alpha."""
    if workers <= 1:
        return 0.0
    return (workers - 1) / workers * payload_bytes / bandwidth + (workers - 1) * latency


def two_step_mean_seconds(workers: int, payload_bytes: float, bandwidth: float, latency: float) -> float:
    """The two-step compressed mean of a `payload_bytes` payload: the all_to_all of its chunks, then the
    all_gather of one chunk from every rank: 2(N-1)/N·payload/B + 2(N-1)·alpha (a ring all-reduce's cost)."""
    return (all_to_all_seconds(workers, payload_bytes, bandwidth, latency)
            + all_gather_seconds(workers, payload_bytes / max(workers, 1), bandwidth, latency))


def average_seconds(workers: int, model_bytes: int, bandwidth: float, latency: float,
                    compression: str = "none") -> float:
    """One average of the weights (float32, `model_bytes`): a ring all-reduce, or the two-step compressed mean."""
    if compression == "none":
        return ring_allreduce_seconds(workers, model_bytes, bandwidth, latency)
    return two_step_mean_seconds(workers, compressed_bytes(model_bytes // FLOAT32_BYTES, compression), bandwidth,
                                 latency)


def gradient_allreduce_seconds(workers: int, model_bytes: int, bandwidth: float, latency: float,
                               compression: str = "none") -> float:
    """One step's gradient exchange: a ring all-reduce of float32, fp16 or bf16 elements; int8 (refused by the
    allreduce strategy) as the two-step compressed mean."""
    if compression == "int8":
        return average_seconds(workers, model_bytes, bandwidth, latency, "int8")
    payload = compressed_bytes(model_bytes // FLOAT32_BYTES, compression)
    return ring_allreduce_seconds(workers, payload, bandwidth, latency)


def overlapped_period_seconds(compute: float, hidden_compute: float, transfer: float, apply: float) -> float:
    """One period of overlapped averaging: its compute, the part of the transfer that the compute of
    the delay (`hidden_compute`) does not hide, and the apply: compute + max(0, transfer - hidden) + apply."""
    return compute + max(0.0, transfer - hidden_compute) + apply


@dataclass(frozen=True)
class Settings:
    """How a strategy runs, where the cost model needs it (defaults: the plain strategies)."""

    every: int = 1  # epochs between averages (sync, fedavg rounds, async merges, overlapped, hierarchical)
    every_steps: Optional[int] = None  # steps between averages instead (local SGD; overlapped; hierarchical)
    compression: str = "none"  # none, fp16, bf16, int8
    delay_steps: Optional[int] = None  # overlapped averaging: steps between sending an average and applying it
    # (None: half the period rounded up, streaming's default --overlap-steps)
    fragments: int = 1  # overlapped averaging: each period sends 1/F of the model (streaming's --fragments)
    ranks_per_node: int = 1  # hierarchical: G ranks per node (the job has N/G nodes)

    def averages_per_epoch(self, steps: int) -> float:
        """Averages per epoch of `steps` steps: 1/every, or steps/every_steps."""
        return steps / self.every_steps if self.every_steps else 1 / self.every

    def per_epoch(self, seconds_per_average: float, steps: int) -> float:
        """Seconds per epoch of averages that take `seconds_per_average` each."""
        if self.every_steps:
            return seconds_per_average * steps / self.every_steps
        return seconds_per_average / self.every


def shard_samples(samples: int, workers: int) -> int:
    return math.ceil(samples / workers)


def steps_per_epoch(samples: int, workers: int, batch_size: int) -> int:
    return max(1, math.ceil(shard_samples(samples, workers) / batch_size))


def _step_allreduce(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """One ring all-reduce of the gradients per step (`every` does not apply)."""
    steps = steps_per_epoch(cal.samples, workers, cal.batch_size)
    return steps * gradient_allreduce_seconds(workers, cal.model_bytes, cal.bandwidth, cal.latency, settings.compression)


def _periodic_allreduce(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """One average of the weights every `every` epochs (or every `every_steps` steps)."""
    steps = steps_per_epoch(cal.samples, workers, cal.batch_size)
    return settings.per_epoch(average_seconds(workers, cal.model_bytes, cal.bandwidth, cal.latency,
                                              settings.compression), steps)


def _merge_service(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """The worker's own round trip to the merge service, unless the one service is the bottleneck."""
    message = cal.latency + cal.model_bytes / cal.bandwidth
    own = 2 * message / settings.every
    service = (workers - 1) * 2 * message / settings.every
    return max(own, service - compute)


def _overlapped_average(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """Averages that run behind the compute of `delay_steps` steps: what each period waits, plus its apply."""
    steps = steps_per_epoch(cal.samples, workers, cal.batch_size)
    periods = settings.averages_per_epoch(steps)
    period_steps = steps / periods
    step_compute = compute / steps
    fragment_bytes = math.ceil(cal.model_bytes / settings.fragments / FLOAT32_BYTES) * FLOAT32_BYTES
    transfer = average_seconds(workers, fragment_bytes, cal.bandwidth, cal.latency, settings.compression)
    delay = math.ceil(period_steps / 2) if settings.delay_steps is None else settings.delay_steps
    hidden = min(delay, period_steps) * step_compute
    period = overlapped_period_seconds(period_steps * step_compute, hidden, transfer, cal.apply_seconds)
    return periods * (period - period_steps * step_compute)


def _hierarchical_allreduce(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """Per step a gradient ring all-reduce inside each node (fast link); per period an average among the nodes."""
    per_node = settings.ranks_per_node
    if per_node < 1 or workers % per_node:
        raise ValueError(f"ranks_per_node {per_node} must divide the {workers} workers")
    steps = steps_per_epoch(cal.samples, workers, cal.batch_size)
    node_bandwidth = cal.node_bandwidth if cal.node_bandwidth is not None else cal.bandwidth
    inside = steps * gradient_allreduce_seconds(per_node, cal.model_bytes, node_bandwidth, cal.node_latency,
                                                settings.compression)
    # a period: the leaders average among the nodes (slow link), then each leader broadcasts to its node (fast link)
    average = average_seconds(workers // per_node, cal.model_bytes, cal.bandwidth, cal.latency, settings.compression)
    handout = cal.model_bytes / node_bandwidth + cal.node_latency if per_node > 1 else 0.0
    return inside + settings.per_epoch(average + handout, steps)


# -- `--strategy auto`'s candidates and its rule (the strategy measures and calls pick; the model predicts it) --

# A safer candidate (listed earlier) is kept when predicted at most this fraction slower than the fastest:
# the model ignores DDP's overlap of the gradient all-reduce with the backward pass, so when allreduce's
# predicted cost is within a few per cent its exactness is worth more than the predicted saving.
TOLERANCE = 0.05


@dataclass(frozen=True)
class Candidate:
    strategy: str  # a registered strategy
    every: int = 1  # epochs between averages (sync) or merges (async)

    @property
    def label(self) -> str:
        return f"{self.strategy} every {self.every}" if self.strategy == "sync" else self.strategy


SAFE_CANDIDATES = (Candidate("allreduce"), Candidate("sync", 1))
ALL_CANDIDATES = SAFE_CANDIDATES + (Candidate("sync", 2), Candidate("sync", 3), Candidate("async", 1))


def pick(candidates: tuple[Candidate, ...], predictions: dict[str, float], tolerance: float = TOLERANCE) -> Candidate:
    """The first candidate (they are listed safest first) predicted within `tolerance` of the fastest:
    the fastest, unless a safer one costs at most that fraction more per epoch."""
    fastest = min(predictions[candidate.label] for candidate in candidates)
    return next(candidate for candidate in candidates if predictions[candidate.label] <= fastest * (1 + tolerance))


def _auto(workers: int, cal: Calibration, settings: Settings, compute: float) -> float:
    """`--strategy auto`: the communication of the default (safe) candidate it would pick (the fastest, or a
    safer one predicted within its tolerance)."""
    seconds = {candidate.label: communication_seconds(registry.STRATEGIES[candidate.strategy].communication, workers,
                                                      cal, Settings(**{**asdict(settings), "every": candidate.every}),
                                                      compute)
               for candidate in SAFE_CANDIDATES}
    return seconds[pick(SAFE_CANDIDATES, {label: compute + comm for label, comm in seconds.items()}).label]


# Seconds of communication per epoch, by the `communication` a strategy's registry entry names.
COMMUNICATION: dict[str, Callable[[int, Calibration, Settings, float], float]] = {
    "step-allreduce": _step_allreduce,
    "periodic-allreduce": _periodic_allreduce,
    "merge-service": _merge_service,
    "overlapped-average": _overlapped_average,
    "hierarchical-allreduce": _hierarchical_allreduce,
    "auto": _auto,
}


def communication_seconds(pattern: str, workers: int, cal: Calibration, settings: Settings = Settings(),
                          compute: Optional[float] = None) -> float:
    """Seconds of communication per epoch (beyond compute) of a communication `pattern` (COMMUNICATION)."""
    if pattern not in COMMUNICATION:
        raise ValueError(f"communication pattern must be one of {tuple(COMMUNICATION)}, not {pattern!r}")
    if workers <= 1:
        return 0.0
    if compute is None:
        compute = shard_samples(cal.samples, workers) * cal.seconds_per_sample
    return COMMUNICATION[pattern](workers, cal, settings, compute)


def epoch_seconds(strategy: str, workers: int, cal: Calibration, every: int = 1,
                  settings: Optional[Settings] = None) -> dict:
    """{'compute', 'communication', 'total'} seconds of one epoch of `strategy` on `workers`.

    `settings` (compression, local-SGD steps, overlap delay, ranks per node) replaces `every` when given."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    settings = settings or Settings(every=every)
    compute = shard_samples(cal.samples, workers) * cal.seconds_per_sample
    communication = communication_seconds(registry.STRATEGIES[strategy].communication, workers, cal, settings, compute)
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
