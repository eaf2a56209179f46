"""The one training loop, for every strategy: shard, step, let the strategy communicate, evaluate.

    trainer = Trainer(model, optimizer, "cross-entropy", strategy=Sync(every=1))
    summary = trainer.fit((x_train, y_train), (x_test, y_test), epochs=10)

Under a launcher (dptrain's own, torchrun, srun, mpirun) every rank runs this same code; in a
plain `python script.py` it trains as one worker. A strategy only decides what is
communicated and when, through the hooks of dptrain.strategies.base.Strategy.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from dptrain.data.dstensor import DSTensor
from dptrain.errors import Preempted, UserError
from dptrain.runtime.distributed import DistContext, PeerFailure, init_process_group
from dptrain.runtime.env import detect
from dptrain.strategies.base import Strategy
from dptrain.train import checkpoint, sharding
from dptrain.io import append_jsonl, write_json, write_jsonl

ArrayLike = Union[DSTensor, np.ndarray, torch.Tensor]
Split = tuple[ArrayLike, ArrayLike]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EVAL_BATCH = 1024


def as_dstensor(data: ArrayLike) -> DSTensor:
    return data if isinstance(data, DSTensor) else DSTensor.from_array(data)


def make_loss(loss: Union[str, LossFn]) -> LossFn:
    if callable(loss):
        return loss
    if loss == "cross-entropy":
        return nn.CrossEntropyLoss()
    if loss == "mse":
        mse = nn.MSELoss()
        return lambda output, target: mse(output, target.reshape(output.shape))
    raise ValueError(f"unknown loss {loss!r}: use 'cross-entropy', 'mse' or a callable")


@dataclass
class EpochStats:
    """What one worker measured in one epoch."""

    rank: int
    samples: int
    train_loss: float
    train_seconds: float
    comm_bytes: int



STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_EARLY_STOP: list[str] = []  # stop signals that arrived before a Trainer watched for them


def catch_stop_signals_early() -> None:
    """From now on, SIGTERM/SIGUSR1 are remembered rather than fatal, and the next Trainer stops at
    its first epoch end with a checkpoint: a warning that reaches a rank while it imports, meets its
    peers or loads data then ends the run cleanly instead of killing that rank."""
    if threading.current_thread() is not threading.main_thread():
        return

    def remember(signum, frame):
        _EARLY_STOP.append(signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        signal.signal(signum, remember)


class Trainer:
    """Data-parallel training of `model` with `strategy` (default: per-step all-reduce)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 loss: Union[str, LossFn] = "cross-entropy", strategy: Optional[Strategy] = None, *,
                 batch_size: int = 32, schedule: Optional[Callable[[torch.optim.Optimizer, int, int], object]] = None,
                 amp: str = "none", grad_clip: Optional[float] = None, seed: int = 0, shuffle: str = "global",
                 device: str = "auto", timeout: float = 300.0, out: Optional[str] = None, progress: bool = True,
                 slowdown: float = 1.0, checkpoint_every: int = 0, keep_checkpoints: int = 2,
                 resume: bool = False, ctx: Optional[DistContext] = None,
                 log: Callable[[str], None] = print) -> None:
        if strategy is None:
            from dptrain.strategies.allreduce import AllReduce
            strategy = AllReduce()
        self.ctx = ctx or init_process_group(detect(), device=device, timeout=timeout)
        self.model = model.to(self.ctx.device)
        self.optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
        self.loss_fn = make_loss(loss)
        self.strategy = strategy
        self.batch_size = batch_size
        self.schedule = schedule
        self.grad_clip = grad_clip
        self.seed = seed
        self.shuffle = shuffle
        self.slowdown = slowdown
        self.checkpoint_every, self.keep_checkpoints, self.resume = checkpoint_every, keep_checkpoints, resume
        self._signalled: Optional[str] = None
        self.out = Path(out) if out else None
        self.log = log if self.ctx.is_main else (lambda message: None)
        self.show_progress = progress and self.ctx.is_main and (sys.stderr.isatty() or os.environ.get("DPTRAIN_TTY") == "1")
        self.amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
        if amp == "fp16" and self.ctx.device.type != "cuda":
            raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or none")
        self.scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
        self.history: list[dict] = []

    # -- the loop -----------------------------------------------------------------------
    def fit(self, train: Split, test: Optional[Split] = None, epochs: int = 1) -> dict:
        """Train for `epochs`; return the summary (also written to OUT/summary.json)."""
        x_train, y_train = (as_dstensor(a) for a in train)
        if len(x_train) != len(y_train):
            raise UserError(f"x has {len(x_train)} samples but y has {len(y_train)}; they must match")
        rank = self.ctx.rank
        steps, order_of, fixed_rows = self._plan(len(x_train), y_train)
        scheduler = self.schedule(self.optimizer, steps, epochs) if self.schedule else None
        torch.manual_seed(self.seed + rank)  # dropout and friends differ per worker, reproducibly
        train_model = self._guard("setup", lambda: self.strategy.setup(self.model, self.optimizer, self.ctx))
        if fixed_rows is not None:  # the shard never changes: read it once
            xs, ys = self._to_tensor(x_train.take(fixed_rows)), self._to_tensor(y_train.take(fixed_rows))

        start_epoch, step, wall_before = self._restore(scheduler) if self.resume else (0, 0, 0.0)
        self._watch_signals()
        started = time.perf_counter() - wall_before
        global_model_evaluated = False
        for epoch in range(start_epoch, epochs):
            epoch_start = time.perf_counter()
            order = order_of(epoch)
            if fixed_rows is None:
                xs, ys = self._to_tensor(x_train.take(order)), self._to_tensor(y_train.take(order))
                positions = np.arange(len(order))
            else:
                positions = np.searchsorted(fixed_rows, order)
            training = self.strategy.trains_in_epoch(epoch)
            train_model.train()
            loss_sum, seen = 0.0, 0
            bar = tqdm(total=steps if training else 0, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                       disable=not self.show_progress, dynamic_ncols=True)
            for batch in (sharding.batches(positions, steps) if training else []):
                step_start = time.perf_counter()
                batch = torch.from_numpy(batch)
                loss = self._train_step(train_model, xs[batch], ys[batch])
                if self.slowdown > 1:  # straggler emulation: this rank computes `slowdown` times slower
                    time.sleep((self.slowdown - 1) * (time.perf_counter() - step_start))
                step += 1
                if scheduler is not None:
                    scheduler.step()
                self._guard("after_step", lambda: self.strategy.after_step(step))
                loss_sum += loss * len(batch)  # a tensor: no device sync per step
                seen += len(batch)
                if self.show_progress:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            bar.close()
            is_global = self._guard("end_epoch", lambda: self.strategy.end_epoch(epoch))
            train_seconds = time.perf_counter() - epoch_start
            stats = EpochStats(rank, seen, float(loss_sum) / max(seen, 1), train_seconds, self.strategy.comm_bytes)
            test_metrics = self._evaluate_global(test) if (test is not None and is_global) else None
            global_model_evaluated = test_metrics is not None
            self._record(epoch, epochs, stats, test_metrics, time.perf_counter() - started)
            stop = self._stop_requested()
            if stop or (self.checkpoint_every and (epoch + 1) % self.checkpoint_every == 0):
                self._checkpoint(epoch + 1, step, scheduler, time.perf_counter() - started)
            if stop:
                if self.ctx.world_size > 1 and not self.strategy.barrier_free:
                    # No rank exits before every rank's checkpoint is on disk: under srun
                    # --kill-on-bad-exit the first rank to exit with 75 ends the others.
                    done = torch.ones(1, device=self.ctx.collective_device)
                    self._guard("checkpoint before stopping", lambda: dist.all_reduce(done))
                raise Preempted(f"rank {rank}: stopped by {stop} after epoch {epoch + 1}; a checkpoint is saved in "
                                f"{self.out}: run the same command again to continue")

        final = self._guard("finish", self.strategy.finish)
        wall = time.perf_counter() - started
        final_metrics = None
        if test is not None:
            # Reuse the last epoch's evaluation when it was of this very model (not when this
            # attempt resumed after the last epoch and trained nothing, nor under async).
            if global_model_evaluated and not self.strategy.barrier_free:
                final_metrics = {key: self.history[-1][key] for key in ("test_loss", "test_accuracy")}
            else:
                final_metrics = self.evaluate(final, test)
        return self._summarise(final, epochs, wall, final_metrics)

    def _plan(self, n_samples: int, y_train: DSTensor):
        """(steps per epoch, epoch -> sample order, rows read once or None) for this rank.

        A strategy with fixed partitions (fedavg) gets its own rows, permuted each epoch, and
        its own step count; every other strategy shares dptrain.train.sharding, where all
        ranks take the same number of steps.
        """
        rank, world = self.ctx.rank, self.ctx.world_size
        parts = self.strategy.partition(y_train, world, self.seed)
        if parts is not None:
            rows = np.sort(np.asarray(parts[rank]))
            steps = max(1, -(-len(rows) // self.batch_size))

            def partition_order(epoch: int) -> np.ndarray:
                return rows[np.random.default_rng(sharding.derive_seed(self.seed, epoch, rank)).permutation(len(rows))]

            return steps, partition_order, rows
        steps = sharding.steps_per_epoch(n_samples, world, self.batch_size)

        def shard_order(epoch: int) -> np.ndarray:
            return sharding.epoch_indices(n_samples, rank, world, epoch, self.seed, self.shuffle)

        fixed = None if self.shuffle == "global" else np.sort(shard_order(0))
        return steps, shard_order, fixed

    # -- checkpoints and pre-emption ---------------------------------------------------------
    def _checkpoint(self, epoch: int, step: int, scheduler, wall: float) -> None:
        if self.out is None:
            return
        state = {
            "epoch": epoch, "step": step, "wall_seconds": wall,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else {},
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "strategy": self.strategy.state_dict(),
            "rng": checkpoint.rng_state(),
            "history": self.history,
        }
        checkpoint.save(self.out, epoch, self.ctx.rank, state)
        if self.ctx.is_main:
            checkpoint.prune(self.out, self.keep_checkpoints, self.ctx.world_size)

    def _restore(self, scheduler) -> tuple[int, int, float]:
        """Load the newest complete checkpoint (rank 0 chooses it for everyone); (epoch, step, wall)."""
        choice = [None]
        if self.ctx.is_main:
            epoch, notes = checkpoint.latest_complete(self.out, self.ctx.world_size) if self.out else (None, [])
            for note in notes:
                self.log(f"dptrain: {note}")
            choice = [epoch]
        if self.ctx.world_size > 1:
            self._guard("resume", lambda: dist.broadcast_object_list(choice, src=0))
        epoch = choice[0]
        if epoch is None:
            return 0, 0, 0.0
        state = checkpoint.load(self.out, epoch, self.ctx.rank)
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise UserError(f"the checkpoint of epoch {epoch} in '{self.out}' does not fit this model: "
                            f"{checkpoint.first_mismatch(exc)}") from None
        self.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"]:
            scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.strategy.load_state_dict(state["strategy"])
        checkpoint.set_rng_state(state["rng"])
        self.history = list(state["history"])
        if self.ctx.is_main:
            if self.out:  # metrics after the checkpoint belong to the lost attempt
                write_jsonl(self.out / "metrics.jsonl", self.history)
            self.log(f"dptrain: resuming after epoch {epoch} from {self.out}")
        return epoch, state["step"], state["wall_seconds"]

    def _watch_signals(self) -> None:
        """SIGTERM/SIGUSR1 (a scheduler's warning before the time limit) ask for a checkpoint and a clean stop."""
        if not self.checkpoint_every or threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            self._signalled = signal.Signals(signum).name

        for signum in STOP_SIGNALS:
            signal.signal(signum, request_stop)
        if _EARLY_STOP:  # it came while the process was still starting
            self._signalled = _EARLY_STOP[0]
            _EARLY_STOP.clear()

    def _stop_requested(self) -> Optional[str]:
        """The signal that asked this run to stop, agreed by all ranks (one may have been missed)."""
        if not self.checkpoint_every:
            return None
        if self.ctx.world_size == 1 or self.strategy.barrier_free:
            return self._signalled
        flag = torch.tensor([1 if self._signalled else 0], device=self.ctx.collective_device)
        self._guard("stop check", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))
        return (self._signalled or "a signal to another rank") if flag.item() else None

    def _train_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = self.ctx.device
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        autocast = (torch.autocast(device.type, dtype=self.amp_dtype) if self.amp_dtype
                    else contextlib.nullcontext())
        with autocast:
            output = model(x)
            loss = self.loss_fn(output.float(), y)
        scaled = self.scaler.scale(loss) if self.scaler else loss
        self._guard("backward", scaled.backward)
        self.strategy.after_backward(model)
        if self.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # -- evaluation and records ------------------------------------------------------------
    def _evaluate_global(self, test: Split) -> Optional[dict]:
        module, collective = self.strategy.evaluation_target()
        if module is None:
            return None
        return self.evaluate(module, test, collective=collective)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: Split, collective: bool = True) -> dict:
        """Loss and accuracy of `model` over the whole test split.

        Collectively (the model is the same on every rank): each rank evaluates its slice and
        three numbers are summed across ranks (metric traffic, not counted in comm_bytes).
        Otherwise this rank evaluates all of it alone.
        """
        x_test, y_test = (as_dstensor(a) for a in test)
        rank, world = (self.ctx.rank, self.ctx.world_size) if collective else (0, 1)
        x_part, y_part = x_test.shard(rank, world), y_test.shard(rank, world)
        was_training = model.training
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        classify = np.dtype(y_test.dtype).kind in "iu"
        for start in range(0, len(x_part), EVAL_BATCH):
            rows = np.arange(start, min(start + EVAL_BATCH, len(x_part)))
            x = self._to_tensor(x_part.take(rows)).to(self.ctx.device)
            y = self._to_tensor(y_part.take(rows)).to(self.ctx.device)
            output = model(x).float()
            totals[0] += self.loss_fn(output, y).item() * len(rows)
            if classify:
                totals[1] += (output.argmax(dim=1) == y).sum().item()
            totals[2] += len(rows)
        model.train(was_training)
        if world > 1:
            reduced = totals.to(self.ctx.collective_device)
            self._guard("evaluate", lambda: dist.all_reduce(reduced))
            totals = reduced.cpu()
        count = max(totals[2].item(), 1.0)
        return {"test_loss": totals[0].item() / count,
                "test_accuracy": totals[1].item() / count if classify else None}

    def _record(self, epoch: int, epochs: int, stats: EpochStats, test: Optional[dict], wall: float) -> None:
        per_worker: list[EpochStats] = [stats]
        if self.ctx.world_size > 1 and not self.strategy.barrier_free:
            gathered: list = [None] * self.ctx.world_size
            self._guard("metrics", lambda: dist.all_gather_object(gathered, stats))
            per_worker = gathered
        record = {
            "epoch": epoch + 1,
            "test_loss": test["test_loss"] if test else None,
            "test_accuracy": test["test_accuracy"] if test else None,
            "evaluated": test is not None,
            "wall_seconds": wall,
            "lr": self.optimizer.param_groups[0]["lr"],
            **self._aggregate(per_worker),
        }
        self.history.append(record)
        if self.ctx.is_main:
            if self.out:
                append_jsonl(self.out / "metrics.jsonl", record)
            accuracy = f"  test_acc {test['test_accuracy']:.4f}" if test and test["test_accuracy"] is not None else ""
            test_loss = f"  test_loss {test['test_loss']:.4f}" if test else ""
            self.log(f"epoch {epoch + 1}/{epochs}  train_loss {record['train_loss']:.4f}{test_loss}{accuracy}  "
                     f"{record['epoch_seconds']:.2f} s  {record['samples_per_second']:.0f} samples/s  "
                     f"comm {record['comm_bytes'] / 1e6:.3f} MB")

    def _complete_history(self) -> None:
        """Barrier-free runs record only rank 0's numbers live; gather every worker's at the end."""
        gathered: list = [None] * self.ctx.world_size
        mine = {record["epoch"]: record["workers"][0] for record in self.history}
        self._guard("metrics", lambda: dist.all_gather_object(gathered, mine))
        for record in self.history:
            workers = [EpochStats(**theirs[record["epoch"]]) for theirs in gathered if record["epoch"] in theirs]
            record.update(self._aggregate(workers))
        if self.ctx.is_main and self.out:
            write_jsonl(self.out / "metrics.jsonl", self.history)

    @staticmethod
    def _aggregate(per_worker: list[EpochStats]) -> dict:
        samples = sum(s.samples for s in per_worker)
        return {
            "train_loss": sum(s.train_loss * s.samples for s in per_worker) / max(samples, 1),
            "samples_per_second": sum(s.samples / max(s.train_seconds, 1e-9) for s in per_worker),
            "comm_bytes": sum(s.comm_bytes for s in per_worker),
            "epoch_seconds": max(s.train_seconds for s in per_worker),
            "workers": [vars(s) for s in per_worker],
        }

    def _summarise(self, final: nn.Module, epochs: int, wall: float, test: Optional[dict]) -> dict:
        comm = [self.strategy.comm_bytes]
        if self.ctx.world_size > 1:
            if self.strategy.barrier_free:
                self._complete_history()
            comm = [None] * self.ctx.world_size
            self._guard("summary", lambda: dist.all_gather_object(comm, self.strategy.comm_bytes))
        samples = sum(sum(w["samples"] for w in record["workers"]) for record in self.history)
        summary = {
            "strategy": self.strategy.name,
            "strategy_options": self.strategy.describe(),
            "workers": self.ctx.world_size,
            "epochs": epochs,
            "test_accuracy": test["test_accuracy"] if test else None,
            "test_loss": test["test_loss"] if test else None,
            "wall_seconds": wall,
            "samples_per_second": samples / max(wall, 1e-9),
            "comm_bytes": sum(comm),
            "comm_bytes_per_worker": comm,
            "model_parameters": sum(p.numel() for p in final.parameters()),
            "backend": self.ctx.backend,
            "device": str(self.ctx.device),
            "launcher": self.ctx.launcher,
            "seed": self.seed,
            **self.strategy.summary(),
        }
        if self.ctx.is_main and self.out:
            torch.save({k: v.detach().cpu() for k, v in final.state_dict().items()}, self.out / "model.pt")
            write_json(self.out / "summary.json", summary)
        return summary

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _to_tensor(array: np.ndarray) -> torch.Tensor:
        """Features and regression targets as float32, class labels as int64, whatever the file held."""
        if array.dtype.kind == "f" and array.dtype != np.float32:
            array = array.astype(np.float32)
        elif array.dtype.kind in "iu" and array.dtype != np.int64:
            array = array.astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(array))

    def _guard(self, what: str, action: Callable):
        """Run `action`; turn a failed or timed-out collective into one line naming this rank."""
        begun = time.perf_counter()
        try:
            return action()
        except (dist.DistError, RuntimeError) as exc:
            if self.ctx.world_size == 1 or not _looks_like_peer_failure(exc):
                raise
            waited = time.perf_counter() - begun
            who = self.ctx.heartbeat.silent_peers() if self.ctx.heartbeat else "no heartbeat store to tell which peer"
            raise PeerFailure(
                f"rank {self.ctx.rank}: {what} failed after {waited:.1f} s (timeout {self.ctx.timeout:g} s): {who}; "
                f"cause: {str(exc).splitlines()[0]}") from None


def _looks_like_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("connection", "timed out", "timeout", "gloo", "nccl", "peer", "closed"))
