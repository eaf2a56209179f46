"""auto: measure the link and the model at start, then train with the candidate the cost model predicts fastest.

After the process group is up and before the first step, every rank measures

- the link: a few all-reduces of one float (latency, alpha = median / 2(N-1)) and of LINK_BYTES
  (bandwidth, from the median: 2(N-1)/N · bytes / (median - 2(N-1)·alpha)), the same ring formula
  the cost model uses (dptrain.costmodel.ring_allreduce_seconds), so the two agree;
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

import json
import statistics
import time
from typing import Callable, Optional

import torch

from dptrain import costmodel, lr_policy, registry
# The candidates and the rule that picks among them are the cost model's (it predicts `--strategy auto`
# with them); they are auto's names too.
from dptrain.costmodel import ALL_CANDIDATES, SAFE_CANDIDATES, TOLERANCE, Candidate, pick  # noqa: F401
from dptrain.strategies.base import Strategy
from dptrain.strategies.rules.auto import AutoRules

CANDIDATE_SETS = ("safe", "all")
LINK_BYTES = 4 * 2 ** 20  # payload of the bandwidth all-reduces
LATENCY_REPEATS, BANDWIDTH_REPEATS, COMPUTE_STEPS = 7, 3, 5
CHOICE_FILE = "strategy_choice.json"
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
    predictions = {}
    for candidate in candidates:
        settings = costmodel.Settings(every=candidate.every,
                                      compression="none" if candidate.strategy == "async" else compression)
        predictions[candidate.label] = costmodel.epoch_seconds(candidate.strategy, workers, cal,
                                                               settings=settings)["total"]
    return predictions


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
        ctx.group.all_reduce(tensor)  # warm-up: connections, buffers
        return [_timed(ctx, lambda: ctx.group.all_reduce(tensor)) for _ in range(repeats)]

    tiny_times = ctx.group.bounded("auto: measuring the latency", lambda: times(tiny, LATENCY_REPEATS))
    big_times = ctx.group.bounded("auto: measuring the bandwidth", lambda: times(big, BANDWIDTH_REPEATS))
    latency = latency_from(statistics.median(tiny_times), workers)
    return {"latency_seconds": latency,
            "bandwidth_bytes_per_second": bandwidth_from(statistics.median(big_times), payload_bytes, workers, latency),
            "tiny_allreduce_seconds": tiny_times, "payload_bytes": payload_bytes, "payload_allreduce_seconds": big_times}


# A training step as the Trainer takes it, without communication: step(model, optimizer, inputs, targets).
Step = Callable[[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], None]


def measure_compute(step: Step, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx, batch_size: int,
                    train, steps: int = COMPUTE_STEPS, statistic: Callable[[list], float] = statistics.median) -> float:
    """Median (or `statistic`) of the seconds per sample of `steps` training steps (after one warm-up), each `step` (the caller's:
    the Trainer's Trainer.timing_step) of `model` with a fresh optimizer of `optimizer`'s kind, on the first
    batches of this rank's part of `train`. The model's parameters, buffers and gradients are put back
    afterwards; `optimizer`, the data order and the RNG streams are left as they were."""
    from dptrain.data.sampler import loader

    n = len(train)
    first = (ctx.rank * batch_size * (steps + 1)) % n
    rows = [[(first + i * batch_size + j) % n for j in range(min(batch_size, n))] for i in range(steps + 1)]
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    timed_optimizer = _same_kind_of_optimizer(optimizer, model)
    per_sample = []
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            if getattr(train, "is_stream", False):  # shards (an IterableDataset): its first samples in file order
                x_all, y_all = train.probe(batch_size * len(rows))[0]
                picks = torch.arange(batch_size * len(rows)) % len(y_all)
                batches = iter([(x_all[pick], y_all[pick]) for pick in picks.split(min(batch_size, len(y_all)))])
            else:
                batches = iter(loader(train, rows))

            def one_step() -> int:  # reading the batch is part of a step, as in the Trainer
                x, y = next(batches)
                step(model, timed_optimizer, x, y)
                return len(y)

            for _ in rows:
                sizes = []
                seconds = _timed(ctx, lambda: sizes.append(one_step()))
                per_sample.append(seconds / sizes[0])
    finally:
        with torch.no_grad():
            state = model.state_dict()
            for name, value in saved.items():
                state[name].copy_(value)
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        model.train(was_training)
    return statistic(per_sample[1:] or per_sample)


def _same_kind_of_optimizer(optimizer: torch.optim.Optimizer, model) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and settings over the model's parameters (its state is thrown
    away after the measurement); plain SGD when the class cannot be built that way."""
    try:
        return type(optimizer)(model.parameters(), **optimizer.defaults)
    except Exception:  # noqa: BLE001 - a user's optimizer with other constructor arguments: time SGD
        return torch.optim.SGD(model.parameters(), lr=1e-3)


# -- the strategy -----------------------------------------------------------------------------------

class Auto(AutoRules, Strategy):
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
        """The LR (and the schedule's warm-up) as `--strategy <chosen>` would set it (dptrain.lr_policy.rescale_for)."""
        if self.config is None:
            return
        rescaled = lr_policy.rescale_for(self.config, chosen.strategy, trainer.ctx.world_size, trainer.optimizer,
                                         trainer.schedule)
        trainer.schedule, trainer.lr_scale = rescaled.schedule, rescaled.lr_scale
        if rescaled.line is not None:
            trainer.recorder.log(rescaled.line)

    def _reused(self, trainer) -> Optional[dict]:
        """The choice recorded when this run began, when it is continued (every rank gets rank 0's)."""
        choice = None
        if trainer.ctx.is_main and trainer.resume and trainer.out is not None and (trainer.out / CHOICE_FILE).is_file():
            choice = {**json.loads((trainer.out / CHOICE_FILE).read_text()), "reused": True}
        return trainer.ctx.group.broadcast_object("auto: reading the recorded choice", choice)

    def _decide(self, trainer, train) -> dict:
        ctx = trainer.ctx
        link = measure_link(ctx)
        seconds = measure_compute(trainer.timing_step, trainer.model, trainer.optimizer, ctx, trainer.batch_size, train)
        per_sample = ctx.group.gather_objects("auto: gathering compute times", seconds)
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
        return ctx.group.broadcast_object("auto: sharing the choice", choice)

    def setup(self, model, optimizer, ctx):
        raise RuntimeError("strategy auto picks a strategy when training starts: pass it to a Trainer, which calls "
                           "resolve() before setup()")

    def describe(self) -> dict:
        return {"name": self.name, "candidates": self.which, "compression": self.compression}
