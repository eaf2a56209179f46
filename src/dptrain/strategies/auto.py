"""auto: measure the link and the model at start, then train with the candidate the cost model predicts fastest.

After the process group is up and before the first step, every rank measures

- the link: a few all-reduces of one float (latency, alpha = median / 2(N-1)) and of LINK_BYTES
  (bandwidth, from the median: 2(N-1)/N · bytes / (median - 2(N-1)·alpha)), the same ring formula
  the cost model uses (dptrain.bench.costmodel.ring_allreduce_seconds), so the two agree;
- the compute: COMPUTE_STEPS training steps (after one warm-up) of the actual model on actual
  batches of the training set with an optimizer of the same kind, median seconds per sample.
  These steps run on the model and then put back every parameter and buffer exactly as they
  were; the run's own optimizer, data order and random number generators are not touched, so
  the run that follows is the one `--strategy <chosen>` with the same flags would train.

Rank 0 takes the slowest rank's compute (a period waits for it), predicts the epoch time of
each candidate with the cost model, picks the fastest, except that a candidate listed earlier (the
safer) is kept when it is predicted at most TOLERANCE (5 %) slower (the model ignores DDP's overlap
of communication with the backward pass, so allreduce's cost is if anything overestimated),
prints one line saying what it chose and why, and broadcasts the choice so every rank agrees.
The choice, the measurements and every prediction go into summary.json (strategy_options.auto)
and into OUT/strategy_choice.json, which a restarted or resumed run reads back instead of
measuring again (its checkpoints belong to the strategy chosen first).

Which candidates (`--auto-candidates`): only those expected to hold accuracy are tried by default
(`safe`): allreduce, which is single-process SGD on the union of the batches, and sync averaging
every epoch, which on shards that see the same distribution reached allreduce's accuracy in the
benchmarks (within 0.3 points, benchmarks/README.md section 2b). Averaging only every 2 or 3 epochs,
and async merging, send less but let the replicas drift further apart, which costs accuracy
depending on the model and learning rate; they are tried only with `--auto-candidates all`.
With one worker nothing is communicated: auto trains as allreduce (the same as any strategy
alone) without measuring, and says so.
"""

from __future__ import annotations

import functools

import json
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dptrain import registry
from dptrain.runtime.guard import broadcast_object, gather_objects, guard
from dptrain.strategies.base import Strategy

CANDIDATE_SETS = ("safe", "all")
LINK_BYTES = 4 * 2 ** 20  # payload of the bandwidth all-reduces
LATENCY_REPEATS, BANDWIDTH_REPEATS, COMPUTE_STEPS = 7, 3, 5
CHOICE_FILE = "strategy_choice.json"
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


def candidates_of(which: str) -> tuple[Candidate, ...]:
    if which not in CANDIDATE_SETS:
        raise ValueError(f"candidates must be one of {CANDIDATE_SETS}, not {which!r}")
    return SAFE_CANDIDATES if which == "safe" else ALL_CANDIDATES


# -- the decision: pure functions of the measurements -------------------------------------------------

def latency_from(tiny_seconds: float, workers: int) -> float:
    """alpha from the time of a ring all-reduce of (almost) nothing: t / 2(N-1)."""
    return tiny_seconds / (2 * (workers - 1))


def bandwidth_from(seconds: float, payload_bytes: int, workers: int, latency: float) -> float:
    """Bytes per second from the time of a ring all-reduce of `payload_bytes`: 2(N-1)/N · M / (t - 2(N-1)·alpha)."""
    transfer = max(seconds - 2 * (workers - 1) * latency, 1e-9)
    return 2 * (workers - 1) / workers * payload_bytes / transfer


def predict(candidates: tuple[Candidate, ...], workers: int, cal, compression: str = "none") -> dict[str, float]:
    """Predicted seconds per epoch of each candidate (by label), from a costmodel.Calibration.
    Compression applies to the averages and gradients it compresses, not to async merges."""
    from dptrain.bench import costmodel

    predictions = {}
    for candidate in candidates:
        settings = costmodel.Settings(every=candidate.every,
                                      compression="none" if candidate.strategy == "async" else compression)
        predictions[candidate.label] = costmodel.epoch_seconds(candidate.strategy, workers, cal,
                                                               settings=settings)["total"]
    return predictions


def pick(candidates: tuple[Candidate, ...], predictions: dict[str, float], tolerance: float = TOLERANCE) -> Candidate:
    """The first candidate (they are listed safest first) predicted within `tolerance` of the fastest:
    the fastest, unless a safer one costs at most that fraction more per epoch."""
    fastest = min(predictions[candidate.label] for candidate in candidates)
    return next(candidate for candidate in candidates if predictions[candidate.label] <= fastest * (1 + tolerance))


def decision_line(choice: dict) -> str:
    """The one line rank 0 prints."""
    if choice["workers"] == 1:
        return "dptrain: --strategy auto with 1 worker: nothing to communicate, training as allreduce (no measurement)"
    measured = choice["measured"]
    predicted = ", ".join(f"{label} {seconds:.3g} s" for label, seconds in choice["predicted_epoch_seconds"].items())
    return (f"dptrain: --strategy auto chose {choice['chosen']}: predicted seconds per epoch {predicted} "
            f"({choice['candidates']} candidates; measured link {measured['bandwidth_bytes_per_second'] * 8 / 1e6:.4g} "
            f"Mbit/s, latency {measured['latency_seconds'] * 1e6:.0f} us, compute "
            f"{measured['seconds_per_sample'] * 1e6:.4g} us per sample on the slowest of {choice['workers']} ranks)")


# -- the measurements -----------------------------------------------------------------------------------

def _timed(ctx, action) -> float:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    start = time.perf_counter()
    action()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


def measure_link(ctx, payload_bytes: int = LINK_BYTES) -> dict:
    """Median times of all-reduces of one float and of `payload_bytes`; the latency and bandwidth they give."""
    workers = ctx.world_size
    tiny = torch.zeros(1, device=ctx.collective_device)
    big = torch.zeros(payload_bytes // 4, device=ctx.collective_device)

    def times(tensor: torch.Tensor, repeats: int) -> list[float]:
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        return [_timed(ctx, lambda: dist.all_reduce(tensor)) for _ in range(repeats)]

    tiny_times = guard(ctx, "auto: measuring the latency", lambda: times(tiny, LATENCY_REPEATS))
    big_times = guard(ctx, "auto: measuring the bandwidth", lambda: times(big, BANDWIDTH_REPEATS))
    latency = latency_from(statistics.median(tiny_times), workers)
    return {"latency_seconds": latency,
            "bandwidth_bytes_per_second": bandwidth_from(statistics.median(big_times), payload_bytes, workers, latency),
            "tiny_allreduce_seconds": tiny_times, "payload_bytes": payload_bytes, "payload_allreduce_seconds": big_times}


def measure_compute(trainer, train, steps: int = COMPUTE_STEPS) -> float:
    """Median seconds per sample of `steps` training steps (after one warm-up) of the trainer's model
    on the first batches of this rank's part of `train`. The model's parameters and buffers are put
    back afterwards; the trainer's optimizer, data order and RNG streams are left as they were."""
    from dptrain.data.sampler import loader
    from dptrain.train.trainer import AMP_DTYPES

    model, ctx, batch = trainer.model, trainer.ctx, trainer.batch_size
    n = len(train)
    first = (ctx.rank * batch * (steps + 1)) % n
    rows = [[(first + i * batch + j) % n for j in range(min(batch, n))] for i in range(steps + 1)]
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    optimizer = _same_kind_of_optimizer(trainer.optimizer, model)
    dtype = AMP_DTYPES[trainer.amp]
    per_sample = []
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            batches = iter(loader(train, rows))

            def step() -> int:  # reading the batch is part of a step, as in the Trainer
                x, y = next(batches)
                inputs, targets = x.to(ctx.device), y.to(ctx.device)
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = trainer.loss_fn(model(inputs).float(), targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return len(y)

            for _ in rows:
                sizes = []
                seconds = _timed(ctx, lambda: sizes.append(step()))
                per_sample.append(seconds / sizes[0])
    finally:
        with torch.no_grad():
            state = model.state_dict()
            for name, value in saved.items():
                state[name].copy_(value)
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        model.train(was_training)
    return statistics.median(per_sample[1:] or per_sample)


def _same_kind_of_optimizer(optimizer: torch.optim.Optimizer, model) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and settings over the model's parameters (its state is thrown
    away after the measurement); plain SGD when the class cannot be built that way."""
    try:
        return type(optimizer)(model.parameters(), **optimizer.defaults)
    except Exception:  # noqa: BLE001 - a user's optimizer with other constructor arguments: time SGD
        return torch.optim.SGD(model.parameters(), lr=1e-3)


# -- the strategy -----------------------------------------------------------------------------------

class Auto(Strategy):
    """Picks allreduce or sync (or, with candidates='all', sync every 2 or 3 epochs or async) at the
    start of the run by measuring; the Trainer then trains with the chosen strategy (see `resolve`)."""

    name = "auto"

    def __init__(self, candidates: str = "safe", compression: str = "none", config=None) -> None:
        super().__init__()
        self.candidates = candidates_of(candidates)
        self.which, self.compression, self.config = candidates, compression, config

    @classmethod
    def from_config(cls, config) -> "Auto":
        return cls(candidates=config.auto_candidates, compression=config.compression, config=config)

    def build(self, candidate: Candidate) -> Strategy:
        """The chosen strategy, built as `--strategy <name>` (with --sync-every for sync) would build it."""
        cls = registry.load("strategy", candidate.strategy)
        if self.config is not None:
            return cls.from_config(self.config.model_copy(update={"strategy": candidate.strategy,
                                                                  "sync_every": candidate.every}))
        if candidate.strategy == "allreduce":
            return cls(compression=self.compression)
        return cls(every=candidate.every)

    def resolve(self, trainer, train) -> tuple[Strategy, Optional[dict]]:
        """Measure, decide on rank 0, agree on every rank; (the chosen strategy, the record of the choice)."""
        ctx = trainer.ctx
        if ctx.world_size == 1:
            choice = {"workers": 1, "candidates": self.which, "chosen": "allreduce",
                      "reason": "one worker: nothing to communicate"}
        else:
            choice = self._reused(trainer) or self._decide(trainer, train)
        trainer.recorder.log(decision_line(choice) + (" (as decided when the run began)" if choice.get("reused") else ""))
        if ctx.is_main and trainer.out is not None and not choice.get("reused"):
            from dptrain.io import make_dirs, write_json
            make_dirs(trainer.out)
            write_json(trainer.out / CHOICE_FILE, choice)
        chosen = next((c for c in ALL_CANDIDATES if c.label == choice["chosen"]), None)
        assert chosen is not None, f"unknown choice {choice['chosen']!r}"
        self._scale_lr_for(chosen, trainer)
        return self.build(chosen), {key: value for key, value in choice.items() if key != "reused"}

    def _scale_lr_for(self, chosen: Candidate, trainer) -> None:
        """--lr-scaling auto scales the LR as `--strategy <chosen>` would (the launcher could not know it
        before the choice); an explicit rule was already applied for every strategy alike."""
        if self.config is None:
            return
        world = trainer.ctx.world_size
        applied, _ = self.config.lr_scale(world)
        wanted, _ = self.config.model_copy(update={"strategy": chosen.strategy}).lr_scale(world)
        chosen_rule = self.config.model_copy(update={"strategy": chosen.strategy}).lr_scale(world)[1]
        trainer.lr_scale = wanted if chosen_rule == "auto" else 1.0  # only auto's scale is guarded
        if wanted == applied:
            return
        for group in trainer.optimizer.param_groups:
            group["lr"] *= wanted / applied
        chosen_config = self.config.model_copy(update={"strategy": chosen.strategy})
        schedule = trainer.schedule
        if isinstance(schedule, functools.partial) and schedule.args and schedule.args[0] is self.config:
            trainer.schedule = functools.partial(schedule.func, chosen_config, *schedule.args[1:])  # its warm-up
        from dptrain.train.run import lr_line

        trainer.recorder.log(lr_line(chosen_config, world))

    def _reused(self, trainer) -> Optional[dict]:
        """The choice recorded when this run began, when it is continued (every rank gets rank 0's)."""
        choice = None
        if trainer.ctx.is_main and trainer.resume and trainer.out is not None and (trainer.out / CHOICE_FILE).is_file():
            choice = {**json.loads((trainer.out / CHOICE_FILE).read_text()), "reused": True}
        return broadcast_object(trainer.ctx, "auto: reading the recorded choice", choice)

    def _decide(self, trainer, train) -> dict:
        ctx = trainer.ctx
        from dptrain.bench import costmodel

        link = measure_link(ctx)
        per_sample = gather_objects(ctx, "auto: gathering compute times", measure_compute(trainer, train))
        choice = None
        if ctx.is_main:
            parameters = sum(p.numel() for p in trainer.model.parameters())
            cal = costmodel.Calibration(seconds_per_sample=max(per_sample), model_bytes=4 * parameters,
                                        bandwidth=link["bandwidth_bytes_per_second"], latency=link["latency_seconds"],
                                        samples=len(train), batch_size=trainer.batch_size)
            predictions = predict(self.candidates, ctx.world_size, cal, self.compression)
            chosen = pick(self.candidates, predictions)
            choice = {"workers": ctx.world_size, "candidates": self.which, "chosen": chosen.label,
                      "strategy": chosen.strategy, "every": chosen.every,
                      "measured": {**link, "seconds_per_sample": max(per_sample),
                                   "seconds_per_sample_per_rank": per_sample},
                      "calibration": cal.as_dict(), "compression": self.compression,
                      "predicted_epoch_seconds": predictions,
                      "tolerance": TOLERANCE,
                      "reason": (f"{chosen.label} has the smallest predicted epoch" if predictions[chosen.label] ==
                                 min(predictions.values()) else f"{chosen.label} is predicted within "
                                 f"{TOLERANCE:.0%} of the fastest and is the safer")}
        return broadcast_object(ctx, "auto: sharing the choice", choice)

    def setup(self, model, optimizer, ctx):
        raise RuntimeError("strategy auto picks a strategy when training starts: pass it to a Trainer, which calls "
                           "resolve() before setup()")

    def describe(self) -> dict:
        return {"name": self.name, "candidates": self.which, "compression": self.compression}
