"""The one training loop, for every strategy: plan the epoch, step, let the strategy communicate, evaluate, record.

    trainer = Trainer(model, optimizer, "cross-entropy", Sync(every=1), batch_size=32)
    summary = trainer.fit((x_train, y_train), (x_test, y_test), epochs=10)

Under a launcher (dptrain's own, torchrun, srun, mpirun) every rank runs this same code; in a
plain `python script.py` it trains as one worker. The loop composes its parts: the epoch plan
(dptrain.data.sampler), the strategy's hooks (dptrain.strategies.base), the checkpointer, the
recorder and the stop signals; each of them is tested on its own.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dptrain import faults
from dptrain.data.fingerprint import fingerprint
from dptrain.data.sampler import PlanBatches, Rest, TrainData, as_dataset, evaluation_loader, labels_of, loader
from dptrain.errors import Diverged, Interrupted, JoinedTooLate, Left, Preempted, UserError
from dptrain.runtime.distributed import DistContext, init_process_group, store_served
from dptrain.runtime import membership as joining
from dptrain.runtime.group import Group, PeerFailure, PeerReported, UntrustedValue, first_line
from dptrain.runtime.membership import STALL, Membership, note, regroup
from dptrain.runtime.env import detect, launcher_reports_interrupts
from dptrain.strategies.base import Strategy
from dptrain.strategies.rules import step_checkpoints_refused
from dptrain.train import checkpoint_files
from dptrain.train.checkpointer import Checkpointer, describe_interruption
from dptrain.train.health import AverageHealth, LRGuard
from dptrain.train.preemption import StopSignals
from dptrain.train.recorder import EpochStats, Recorder, Summary
from dptrain.train.straggler import StepDelay, measure_delay

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Schedule = Callable[[torch.optim.Optimizer, int, int], object]
EVAL_BATCH = 1024
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_GROWTH_LIMIT = 10.0  # a training loss this many times the first epoch's is divergence


def _workers(count: int) -> str:
    """"1 worker", "3 workers"."""
    return f"{count} worker{'s' if count != 1 else ''}"


def _ranks(ranks) -> str:
    """"rank 2", "ranks 0, 1"."""
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _grew(loss: float, first: float) -> bool:
    """Whether a training loss is past LOSS_GROWTH_LIMIT times the first epoch's (divergence)."""
    return math.isfinite(first) and first > 0 and loss > LOSS_GROWTH_LIMIT * first


def make_loss(loss: Union[str, LossFn]) -> LossFn:
    if callable(loss):
        return loss
    # Targets are cast to what the loss needs (a no-op when they already are): float labels of a
    # classification (--task classify; soft (n, C) targets stay as they are), integer targets of a
    # regression (--task regress).
    if loss == "cross-entropy":
        cross_entropy = nn.CrossEntropyLoss()
        return lambda output, target: cross_entropy(output, target.long() if target.dim() == 1 else target)
    if loss == "mse":
        mse = nn.MSELoss()
        return lambda output, target: mse(output, target.float().reshape(output.shape))
    raise ValueError(f"unknown loss {loss!r}: use 'cross-entropy', 'mse' or a callable")


def check_amp(amp: str, device: torch.device) -> None:
    if amp == "fp16" and device.type != "cuda":
        raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or none")



def received_state(data: bytes, me: int, sender: int, device: torch.device) -> dict:
    """The state a joiner was healed with, read as tensors and plain values only (torch.load's weights_only):
    a peer's bytes that would run code when unpickled are refused in one line, and nothing of them runs."""
    try:
        state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are not a state dptrain sent
        raise UntrustedValue(f"rank {me}: healing the workers that join: rank {sender} sent {len(data)} bytes that "
                             f"are not a dptrain state of tensors and plain values ({first_line(exc)[:160]}); "
                             "nothing of it was run") from None
    if not isinstance(state, dict):
        raise UntrustedValue(f"rank {me}: healing the workers that join: rank {sender} sent a "
                             f"{type(state).__name__}, not a dptrain state")
    return state

class Trainer:
    """Data-parallel training of `model` with `optimizer` (built by you, on the model's parameters).

    `strategy` defaults to AllReduce (per-step gradient all-reduce). `schedule(optimizer,
    steps_per_epoch, epochs)` may return an LR scheduler stepped once per step. With `out`, the
    run directory receives metrics.jsonl, summary.json, model.pt and, every `checkpoint_every`
    epochs (and every `checkpoint_every_steps` steps within an epoch), checkpoints (`resume=True`
    continues from the newest, bit for bit; on another number of workers where the strategy can, and
    never from another run's or one trained on other data, unless `resume_with_changed_data`). Nothing
    joins a process group before `fit`.
    With `min_workers`, the run goes on without failed or departed workers down to that many, and
    workers joining it (`dptrain join`) enter while fewer than `max_workers` train (default: the
    world it started with); `lr_rule(W)` (the factor your LR rule gives W workers) then has the LR follow the live world.
    With `commit_every_steps` too, a strategy whose workers meet at every step (allreduce) keeps its state every
    that many steps in memory, and the survivors go on from the latest such commit they all hold, the rest of
    that epoch's rows shared over them, instead of from the epoch's start.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: Union[str, LossFn] = "cross-entropy",
                 strategy: Optional[Strategy] = None, *, batch_size: int = 32, schedule: Optional[Schedule] = None,
                 amp: str = "none", grad_clip: Optional[float] = None, seed: int = 0, shuffle: str = "global",
                 device: str = "auto", timeout: float = 300.0, out: Optional[str] = None, progress: bool = True,
                 verbose: bool = True, loader_workers: int = 0, checkpoint_every: int = 0,
                 keep_checkpoints: int = 2, resume: bool = False, check_averages: bool = True,
                 stop_on_collapse: bool = False, lr_scale: float = 1.0, checkpoint_every_steps: int = 0,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 lr_rule: Optional[Callable[[int], float]] = None, commit_every_steps: int = 0,
                 resume_with_changed_data: bool = False) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, "
                            f"not {type(optimizer).__name__}")
        if amp not in AMP_DTYPES:
            raise ValueError(f"amp must be one of {sorted(AMP_DTYPES)}, not {amp!r}")
        if strategy is None:
            from dptrain.strategies.allreduce import AllReduce
            strategy = AllReduce()
        self.model, self.optimizer, self.loss_fn, self.strategy = model, optimizer, make_loss(loss), strategy
        # Accuracy is measured for a classification loss; for a loss of your own, when targets are integers.
        self.classify: Optional[bool] = {"cross-entropy": True, "mse": False}.get(loss) if isinstance(loss, str) else None
        self.batch_size, self.schedule, self.amp, self.grad_clip = batch_size, schedule, amp, grad_clip
        self.seed, self.shuffle, self.device, self.timeout = seed, shuffle, device, timeout
        self.out = Path(out) if out else None
        self.progress, self.verbose, self.loader_workers = progress, verbose, loader_workers
        self.checkpoint_every, self.keep_checkpoints, self.resume = checkpoint_every, keep_checkpoints, resume
        self.checkpoint_every_steps = checkpoint_every_steps
        self.resume_with_changed_data = resume_with_changed_data  # resume although the data's fingerprint differs
        # The check of every average (dptrain.train.health); with lr_scale > 1 (the factor --lr-scaling auto
        # multiplied the optimizer's LR by) it also backs that factor off when averages go wrong.
        self.check_averages, self.stop_on_collapse, self.lr_scale = check_averages, stop_on_collapse, lr_scale
        # Live membership: with min_workers, a failed or frozen worker is left behind at the epoch it failed in
        # and the others redo that epoch together (dptrain.runtime.membership); None: a failure ends the run.
        self.min_workers = min_workers
        if max_workers is not None and min_workers is None:
            raise ValueError("max_workers needs min_workers: workers enter a run whose membership changes")
        self.max_workers = max_workers  # joiners enter while fewer train (None: the world the run started with)
        if commit_every_steps and min_workers is None:
            raise ValueError("commit_every_steps needs min_workers: the commits are where the workers left go on from")
        if commit_every_steps < 0:
            raise ValueError(f"commit_every_steps must be 1 or more (0: none), not {commit_every_steps}")
        self.commit_every_steps = commit_every_steps
        self._commits = 0  # steps between this run's commits (0: none; set in fit, for strategies meeting every step)
        self._rest: Optional[Rest] = None  # the rest of an epoch shared out again after a commit (`_continue_without`)
        self._resized: Optional[int] = None  # the workers that wrote the checkpoint resumed, when another number
        # The factor the LR rule gives W workers (dptrain.lr_policy.lr_scale): after a membership change the LR
        # follows the live world (None: it is kept).
        self.lr_rule = lr_rule
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.strategy_choice: Optional[dict] = None  # how --strategy auto chose (summary.json's strategy_options.auto)
        self.data_record: Optional[dict] = None  # what the data was, for summary.json (set by `dptrain train`)
        self.stop_signals = StopSignals()
        self._leaving: Optional[tuple] = None  # (ranks that stay, ranks that leave, their signals) at this epoch end
        self._joining: tuple[int, ...] = ()  # ranks of the job (joiners) the run admits at this epoch end
        self._slowdown = 1.0
        self.step_delay: Optional[StepDelay] = None  # --slow-worker: measured before training (train.straggler)
        self._evaluation: Optional[tuple] = None  # (test set, (rank, world), its DataLoader)
        self._forward_mark: Optional[tuple] = None  # (the DDP model, its forward pre-hook) for _forward
        self._in_user_forward = False

    def emulate_straggler(self, factor: float) -> "Trainer":
        """Make this rank's steps take `factor` times its own compute (benchmarks of unequal workers)."""
        self._slowdown = factor
        return self

    @property
    def history(self) -> list[dict]:
        """The epoch records so far (what metrics.jsonl holds)."""
        return self.recorder.history

    def _connect(self) -> DistContext:
        """Join the process group the launcher describes (a one-rank group when there is none)."""
        self.ctx = init_process_group(detect(), device=self.device, timeout=self.timeout)
        check_amp(self.amp, self.ctx.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == "fp16" else None
        self.model = self.model.to(self.ctx.device)
        # A worker joining a running job is alone until admitted, but never writes the run's files and lines.
        self.recorder = Recorder(self.out, self.ctx.is_main and self.ctx.joining is None, self.verbose, self.progress,
                                 self.ctx.world_size)
        self.checkpointer = Checkpointer(self.out, self.ctx, self.checkpoint_every, self.keep_checkpoints,
                                         self.recorder.log, self.checkpoint_every_steps, self.resume_with_changed_data)
        return self.ctx

    # -- the loop -----------------------------------------------------------------------
    def fit(self, train: TrainData, test: Optional[TrainData] = None, epochs: int = 1) -> Summary:
        """Train for `epochs` on `train` ((x, y) arrays, tensors or DSTensors, or a torch Dataset of (x, y)
        items); evaluate on `test` after each epoch; return the Summary (also written to OUT/summary.json).

        Ctrl-C raises Interrupted, saying after which epoch and what the same command would do again."""
        try:
            return self._fit(train, test, epochs)
        except KeyboardInterrupt:
            ctx = getattr(self, "ctx", None)
            # dptrain's own launchers stop every rank and say it once; elsewhere rank 0 says it.
            said_elsewhere = launcher_reports_interrupts() or ctx is None or not ctx.is_main
            raise Interrupted("" if said_elsewhere else describe_interruption(
                self.out, ctx.world_size, len(self.history), epochs)) from None

    def _fit(self, train: TrainData, test: Optional[TrainData], epochs: int) -> Summary:
        ctx = self._connect()
        if self.min_workers is not None:
            ctx.group.watch = STALL  # a frozen worker is given up after this long without a heartbeat
        train, test = as_dataset(train), (as_dataset(test, "test") if test is not None else None)
        strategy, self.strategy_choice = self.strategy.resolve(self, train)  # auto measures and picks one
        self.strategy = strategy
        if self._slowdown > 1:  # before the strategy wraps the model: timed without any communication
            self.step_delay = measure_delay(self._slowdown, self.timing_step, self.model, self.optimizer, ctx,
                                            self.batch_size, train)
        if self.checkpoint_every_steps and strategy.no_step_checkpoints:
            raise UserError(step_checkpoints_refused(strategy.name, strategy.no_step_checkpoints))
        if self.min_workers is not None and "min_workers" not in strategy.option_names():
            raise UserError(f"min_workers does not apply to strategy {strategy.name}: it cannot go on without a "
                            "lost worker")
        strategy.live, strategy.min_workers = self.min_workers is not None, self.min_workers
        if self.commit_every_steps and not strategy.meets_every_step:
            if self.strategy_choice is None:
                raise UserError(f"commit_every_steps does not apply to strategy {strategy.name}: its workers do not "
                                "meet at every step, so a lost worker's epoch is redone from its start")
            self.recorder.log(f"dptrain: --commit-every-steps does not apply to {strategy.name}, which auto picked: "
                              "a lost worker's epoch is redone from its start")
        labels = lambda: labels_of(train, self.recorder.log)  # noqa: E731 - asked again after a membership change
        self.checkpointer.identify(strategy.name, lambda: fingerprint(train), strategy.refuses_other_world)
        plan, batches, reader = self._plan(train, labels)
        scheduler = self.schedule(self.optimizer, plan.steps, epochs) if self.schedule else None
        torch.manual_seed(self.seed + ctx.rank)  # dropout and friends differ per worker, reproducibly
        train_model = ctx.group.bounded("setup", lambda: strategy.setup(self.model, self.optimizer, ctx))
        parts = {"model": self.model, "optimizer": self.optimizer, "scheduler": scheduler, "scaler": self.scaler,
                 "strategy": strategy}
        health, lr_guard = self._health_checks(train, strategy)
        if lr_guard is not None:
            parts["lr_guard"] = lr_guard
        self._parts, self._health, self._lr_guard = parts, health, lr_guard
        if ctx.joining is not None:  # a worker joining a running job: its state comes from a live peer, not disk
            start_epoch, step, train_model = self._join(train, strategy, parts)
            health, lr_guard = self._health, self._lr_guard
            plan, batches, reader = self._plan(train, labels)
            scheduler = self._reschedule(parts, parts["scheduler"], plan.steps, start_epoch, epochs)
            wall_before, position = 0.0, None
        elif self.resume:
            start_epoch, step, wall_before, position = self._restore(parts, train)
            if self._resized is not None:  # on another world than wrote the checkpoint: its epochs planned anew
                self._scale_lr(self._resized, ctx.world_size)
                plan, batches, reader = self._plan(train, labels)
                scheduler = self._reschedule(parts, scheduler, plan.steps, start_epoch, epochs,
                                             self._rest_steps(start_epoch))
        else:
            start_epoch, step, wall_before, position = 0, 0, 0.0, None
        if ctx.joining is None and position is not None:  # within an epoch: the checks go on as they were
            self._resume_checks(position)
        elif ctx.joining is None and health is not None:  # (a joiner's go on as rank 0's were: _join)
            start_loss = health.start(self.model)
            if lr_guard is not None:
                lr_guard.start(self.model, start_loss)
        self.stop_signals.watch()
        started = self._started = time.perf_counter() - wall_before
        evaluated = False  # whether the last epoch evaluated the global model
        # live membership: this rank's state at this epoch's start or latest commit, and the one before (`_keep`)
        self._snapshots: dict[tuple[int, int], dict] = {}
        changed: Optional[Membership] = None  # the last membership change, recorded with the next epoch
        epoch = start_epoch
        self._commits = self.commit_every_steps if strategy.meets_every_step else 0
        within: Optional[dict] = None  # after a membership change: the commit within the epoch to go on from
        while epoch < epochs:
            if within is not None:
                position, within = within, None
            if self.min_workers is not None and strategy.meets_at_epoch_ends:
                # this rank's state now: at the epoch's start, or at the commit within it it continues from
                self._keep((epoch, position["steps"] if position else 0), step, position)
            elif self.min_workers is not None and (heard := strategy.live_change(epoch)) is not None:
                changed = self._follow(heard)  # async: a lost worker, heard of in a merge; nobody goes back
                plan, batches, reader = self._plan(train, labels)
                scheduler = self._reschedule(parts, scheduler, plan.steps, epoch, epochs)
            try:
                (samples, train_loss, recovered, checked, stats, test_metrics, stop,
                 step) = self._epoch(train_model, reader, batches, epoch, epochs, step, scheduler, health, lr_guard,
                                     test, position)
            except PeerFailure as failure:
                if self.min_workers is None or isinstance(failure, PeerReported) or not strategy.meets_at_epoch_ends:
                    raise  # an error the job shares, or one async cannot go on after (rank 0 lost)
                changed, train_model = self._continue_without(failure, parts, train)
                saved = self._snapshots[(changed.epoch, changed.step)]
                epoch, step, within = changed.epoch, saved["step"], saved["position"]
                plan, batches, reader = self._plan(train, labels)
                scheduler = self._reschedule(parts, scheduler, plan.steps, epoch, epochs, self._rest_steps(epoch))
                continue
            finally:
                position = None
            self._lead_if_taken_over()
            evaluated = test_metrics is not None
            if recovered is not None:
                checked = {**checked, "lr_backoff": recovered}
            if changed is not None:
                checked, changed = {**checked, "membership": note(changed)}, None
            self.recorder.record(epoch, epochs, stats, test_metrics, time.perf_counter() - started,
                                 self.optimizer.param_groups[0]["lr"], checked)
            if checked.get("collapse") and self.stop_on_collapse:
                raise Diverged(f"rank {ctx.rank}: stopped by --stop-on-collapse: {checked['collapse']}")
            if recovered is None:
                self._check_loss_growth(epoch)
            if stop or self.checkpointer.due(epoch + 1):
                self.checkpointer.save(epoch + 1, step, time.perf_counter() - started, parts, self.recorder.history,
                                       members=self._members())
            if stop:
                ctx.group.bounded("checkpoint before stopping", strategy.stop_together)
                self.checkpointer.prune()  # every rank's file of the last checkpoint is written now
                raise Preempted(f"rank {ctx.rank}: stopped by {stop} after epoch {epoch + 1}; a checkpoint is saved "
                                f"in {self.out}: run the same command again to continue")
            if self._leaving is not None:
                changed, train_model = self._let_leave(epoch)
                plan, batches, reader = self._plan(train, labels)
                scheduler = self._reschedule(parts, scheduler, plan.steps, epoch + 1, epochs)
            if self._joining and epoch + 1 < epochs:  # after the last epoch there is nothing left to join
                changed, train_model = self._admit(epoch, step)
                plan, batches, reader = self._plan(train, labels)
                scheduler = self._reschedule(parts, parts["scheduler"], plan.steps, epoch + 1, epochs)
            epoch += 1
        if self.min_workers is not None and ctx.is_main:
            joining.finished(ctx.group.store)  # joiners still waiting for a place go home
        final = ctx.group.bounded("finish", strategy.finish)
        self._lead_if_taken_over()
        if tuple(ctx.group.members) != (self.recorder.members or tuple(range(self.recorder.job_world))):
            # async: a worker lost in the last epochs, after the others last shared the data out
            self.recorder.follow(tuple(ctx.group.members))
        wall = time.perf_counter() - started
        final_metrics = None
        if test is not None:
            # Reuse the last epoch's evaluation when it was of this very model (not when this
            # attempt resumed after the last epoch and trained nothing, nor when others merged later).
            reuse = evaluated and strategy.final_model_is_last_evaluated
            final_metrics = self.recorder.last_evaluation() if reuse else self.evaluate(final, test)
        summary = self._summarise(final, epochs, wall, final_metrics)
        self.checkpointer.prune()  # the summary's gather came after every rank's last save
        return summary

    def _members(self) -> tuple[int, ...]:
        """The ranks of the job training now (async: those live, over a group that stays the job's)."""
        now = self.strategy.members_now()
        if now is not None:
            return now
        return self.recorder.members if self.recorder.members is not None else tuple(self.ctx.group.members)

    def _lead_if_taken_over(self) -> None:
        """async: this rank became rank 0 when the others took over from a lost rank 0 (it holds the global
        model now): it writes the files and lines from here on."""
        if self.ctx.is_main and not self.recorder.is_main and not self.strategy.meets_at_epoch_ends:
            self.recorder.take_over(self.ctx.group.members[self.ctx.rank])

    def _reschedule(self, parts: dict, scheduler, steps: int, epoch: int, epochs: int, rest: Optional[int] = None):
        """After a membership change, before `epoch` (from 0) starts in the new world: the schedule made again
        over the new epoch length (each worker now takes `steps` steps per epoch), at the same point of the run,
        so that a per-step schedule neither runs ahead nor falls behind. `rest`: the steps left of `epoch` when the
        workers go on from within it (allreduce's commits): the schedule stands where those steps end the epoch.
        Returns the schedule to step from now on."""
        if scheduler is None:
            return None
        rebuilt = self.schedule(self.optimizer, steps, epochs)
        ahead = 0 if rest is None else max(0, steps - rest)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a fast-forward, no step
            warnings.simplefilter("ignore")
            for _ in range(epoch * steps + ahead):
                rebuilt.step()
        parts["scheduler"] = rebuilt
        return rebuilt

    def _plan(self, train: Dataset, labels: Callable) -> tuple:
        """This rank's epoch plan, its batches and their reader, for the rank and world it has now (with the rest
        of an epoch shared out again after a commit, `_rest`)."""
        ctx = self.ctx
        plan = self.strategy.epoch_plan(ctx, len(train), labels, self.batch_size, self.seed, self.shuffle,
                                        getattr(train, "block_size", None))
        if self._rest is not None and self._rest.members == tuple(ctx.group.members):
            plan = replace(plan, rest=self._rest, rank=ctx.rank)
        # Checkpoints within an epoch are taken at the same step on every rank: below the fewest steps any
        # rank takes (fedavg's partitions differ in size), so that each one is complete.
        self._common_steps = (min(ctx.group.gather_objects("steps per epoch", plan.steps))
                              if self.checkpoint_every_steps else 0)
        batches = PlanBatches(plan)
        return plan, batches, loader(train, batches, self.loader_workers, pin_memory=ctx.device.type == "cuda")

    def _epoch(self, train_model: nn.Module, reader: DataLoader, batches: PlanBatches, epoch: int, epochs: int,
               step: int, scheduler, health: Optional[AverageHealth], lr_guard: Optional[LRGuard],
               test: Optional[Dataset], position: Optional[dict]) -> tuple:
        """One epoch up to the ranks' last meeting in it (its stats gathered, the stop agreed); nothing written.
        `position`: the checkpoint within this epoch the run resumes from."""
        ctx, strategy = self.ctx, self.strategy
        epoch_start = time.perf_counter() - (position["seconds"] if position else 0.0)
        batches.set_epoch(epoch, position["steps"] if position else 0)
        samples, loss_sum, step = self._train_epoch(train_model, reader, epoch, epochs, step, scheduler, position)
        train_loss = float(loss_sum) / max(samples, 1)
        recovered = self._recover_or_check(train_model, epoch, train_loss, lr_guard, scheduler)
        trained, averages = strategy.trains_in_epoch(epoch), strategy.averaging_events()
        if health is not None:
            health.before(self.model, trained)
        is_global = ctx.group.bounded("end_epoch", lambda: strategy.end_epoch(epoch))
        checked = {}
        if health is not None and strategy.averaging_events() > averages:
            checked = self._check_average(health, lr_guard, epoch, trained, scheduler)
        stats = EpochStats(ctx.rank, samples, train_loss, time.perf_counter() - epoch_start, strategy.comm_bytes)
        test_metrics = self._evaluate_global(test) if (test is not None and is_global) else None
        gathered = strategy.gather_stats(stats)
        stop = self._agree_stop() if self.checkpointer.enabled else None
        return samples, train_loss, recovered, checked, gathered, test_metrics, stop, step

    def _agree_stop(self) -> Optional[str]:
        """The stop signal the whole run obeys at this epoch end, or None. With min_workers, ranks asked to stop
        while others were not (a scheduler warned one node) leave instead, at this epoch end (`_leaving`), when
        at least min_workers stay and none of them hosts the store (rank 0 where the launcher does not)."""
        ctx, requested = self.ctx, self.stop_signals.requested
        if self.min_workers is None or not self.strategy.meets_at_epoch_ends:
            return self.strategy.agree_stop(requested)
        # Rank 0 also says which joiners are ready, while fewer workers train than max_workers (or the job's start).
        room = (self.max_workers or self.recorder.job_world) - ctx.world_size
        ready = (joining.ready_joiners(ctx.group.store, room)
                 if ctx.is_main and ctx.group.store is not None else ())
        if ctx.world_size == 1:
            self._joining = ready
            return self.strategy.agree_stop(requested)
        told = ctx.group.gather_objects("stop check", (requested, ready))
        asked = [signal for signal, _ in told]
        self._joining = tuple(told[0][1])
        leave = tuple(member for member, signal in zip(ctx.group.members, asked) if signal)
        stay = tuple(member for member in ctx.group.members if member not in leave)
        if not leave:
            return None
        # Rank 0 cannot leave where it serves the store (not under dptrain's launcher, which serves it itself).
        if len(stay) < self.min_workers or (0 in leave and not store_served()):
            # the job stops: checkpoint and exit 75, as without min_workers
            self._joining = ()
            return requested or "a signal to another rank"
        self._leaving = (stay, leave, tuple(signal for signal in asked if signal))
        return None

    def _take(self, group) -> nn.Module:
        """Train on in `group` (made after a membership change): this rank's place in it; rank 0 may be the one
        gone, so the lowest rank left writes the files and lines from now on. Returns the module to train: the
        strategy's, rebuilt on the new group (`regroup`)."""
        ctx = self.ctx
        self._scale_lr(ctx.world_size, group.world_size)
        ctx.rank, ctx.world_size, ctx.group = group.rank, group.world_size, group
        self.recorder.lead(ctx.is_main)
        self.recorder.follow(tuple(group.members))
        if self._forward_mark is not None:  # nothing may keep the old group's DDP (its hooks) alive
            self._forward_mark[1].remove()
            self._forward_mark = None
        return ctx.group.bounded("regroup", lambda: self.strategy.regroup(ctx))

    def _scale_lr(self, world_before: int, world: int) -> None:
        """The LR rule's factor for the live world instead of the one before (optimizer, schedule, the guard's
        scale), where the trainer was given the rule (`lr_rule`)."""
        if self.lr_rule is None or world == world_before:
            return
        ratio = self.lr_rule(world) / self.lr_rule(world_before)
        if ratio == 1:
            return
        for group in self.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        if self._lr_guard is not None:
            self._lr_guard.scale *= ratio
        self.recorder.log(f"dptrain: learning rate x {ratio:.3g} for {_workers(world)} instead of {world_before} "
                          f"(the LR rule follows the live world): {self.optimizer.param_groups[0]['lr']:g}")

    def _follow(self, heard: Membership) -> Membership:
        """async (no common epoch end): from this epoch on train in the live world `heard` of a merge reply
        (the LR rule's W follows it; the trainer shares the data out again); the group stays until the end."""
        before = self.recorder.members or range(self.recorder.job_world)
        self._scale_lr(len(before), len(heard.members))
        self.recorder.follow(heard.members)
        self.recorder.log(f"dptrain: without {_ranks(heard.left)}: {_workers(len(heard.members))} share the data "
                          f"from epoch {heard.epoch + 1} ({_ranks(heard.members)} of the job); async merged over "
                          f"them since the loss")
        return heard

    def _let_leave(self, epoch: int) -> tuple[Membership, nn.Module]:
        """After `epoch` (from 0) ended: the ranks asked to stop alone leave (Left, exit 75) and the others go
        on without them from the next epoch, in a group of their own (no state to return to: nothing failed)."""
        ctx = self.ctx
        stay, leave, signals = self._leaving
        self._leaving = None
        me, names = ctx.group.members[ctx.rank], ", ".join(map(str, leave))
        generation = ctx.group.generation + 1
        ctx.group.abandon()  # nobody waits in it: its last collective (the stop check) is over
        if me in leave:
            raise Left(f"rank {me}: left the run after epoch {epoch + 1} on {signals[0]}; the other "
                       f"{len(stay)} worker{'s' if len(stay) > 1 else ''} go on without it")
        group = ctx.group.rebuild(stay, generation)
        assert group is not None
        train_model = self._take(group)
        self.recorder.log(f"dptrain: rank{'s' if len(leave) > 1 else ''} {names} left after epoch {epoch + 1} "
                          f"on request ({signals[0]}); continuing with {_workers(group.world_size)} ({_ranks(stay)} of the job)")
        return Membership(generation, stay, epoch + 1, leave), train_model

    def _admit(self, epoch: int, step: int) -> tuple[Membership, nn.Module]:
        """After `epoch` (from 0) ended: the joiners rank 0 found ready enter; each is healed from rank 0 (its
        whole state, over the new group) and every worker trains on from the next epoch. A joiner lost before it
        trained is left out again at once (the others go on as they were)."""
        ctx, joiners = self.ctx, self._joining
        self._joining = ()
        old = ctx.group
        generation, members = old.generation + 1, (*old.members, *joiners)
        if ctx.is_main:
            joining.admit(old.store, joiners, generation, members, epoch + 1)
        names = ", ".join(map(str, joiners))
        group = old.bounded(f"admitting rank{'s' if len(joiners) > 1 else ''} {names}",
                            lambda: old.rebuild(members, generation))
        try:
            healed = len(self._heal(group, epoch + 1, step))
        except PeerFailure as failure:  # a joiner died before it trained: the others go on without it
            self.recorder.log(f"dptrain: {failure}; the workers agree on who is left")
            group, membership = regroup(group, generation + 1, epoch + 1, min_workers=self.min_workers,
                                        timeout=self.timeout)
            return membership, self._take(group)
        train_model = self._take(group)
        self.recorder.log(f"dptrain: rank{'s' if len(joiners) > 1 else ''} {names} joined after epoch {epoch + 1}, "
                          f"healed from rank {members[0]} ({healed / 1e6:.2f} MB of state); continuing with "
                          f"{_workers(group.world_size)} ({_ranks(members)} of the job)")
        return Membership(generation, members, epoch + 1, (), joiners, healed), train_model

    def _heal(self, group: Group, epoch: int, step: int) -> bytes:
        """Rank 0 of `group` hands its whole state to every other worker of it in one broadcast of bytes (the
        joiners load it in `_join`, tensors and plain values only; the others already hold theirs). Returns it,
        serialized."""
        state = None
        if group.rank == 0:
            state = {**self._snapshot(self._parts, step), "epoch": epoch, "world": self.ctx.world_size,
                     "strategy_name": self.strategy.name,
                     "job_world": self.recorder.job_world,
                     "health": self._health.state_dict() if self._health is not None else None,
                     # the LR guard's kept average decides whether a divergence can be taken back: every worker
                     # must decide alike (a checkpoint within an epoch keeps it too)
                     "lr_guard_good": self._lr_guard.good_state() if self._lr_guard is not None else None}
            buffer = io.BytesIO()
            torch.save(state, buffer)
            state = buffer.getvalue()
        return group.broadcast_bytes("healing the workers that join", state)

    def _join(self, train: Dataset, strategy: Strategy, parts: dict) -> tuple[int, int, nn.Module]:
        """A worker joining a running job (ctx.joining: its rank of the job), prepared alone: say it is ready,
        wait for the run to admit it at an epoch end, take the state of the new group's rank 0 and its place in
        the group. Returns (the epoch to start from, the step count, the module to train)."""
        ctx = self.ctx
        me, store = ctx.joining, ctx.group.store
        joining.announce(store, me)
        print(f"dptrain: rank {me} is ready to join the run; it enters at the next epoch end with a free place",
              flush=True)
        try:
            admitted = joining.admission(store, me)
        except Exception as exc:  # noqa: BLE001 - the store's host (the run's launcher) is gone
            if self.out is not None and (self.out / "summary.json").exists():  # it ended, and its launcher with it
                raise JoinedTooLate(f"rank {me}: the run ended before a place was free; this worker did not "
                                    "join") from None
            raise PeerFailure(f"rank {me}: the run's store stopped answering while this worker waited to join "
                              f"({first_line(exc)}): the run has ended or its launcher is gone") from None
        if admitted is None:
            raise JoinedTooLate(f"rank {me}: the run ended before a place was free; this worker did not join")
        generation, members, epoch = admitted
        group = ctx.group.bounded("joining the run", lambda: Group.over_store(
            store, me, members, generation, device=ctx.device, backend=ctx.backend, timeout=self.timeout,
            heartbeat=ctx.heartbeat))
        group.watch = ctx.group.watch
        state = received_state(self._heal(group, epoch, 0), me, members[0], ctx.device)
        if state["strategy_name"] != strategy.name:  # --strategy auto: the choice recorded when the run began
            raise PeerFailure(f"rank {me}: the run trains with {state['strategy_name']}, this worker prepared "
                              f"{strategy.name}; it cannot join")
        ctx.world_size = state["world"]  # the world rank 0 trained in: the LR rule scales from it (_take)
        health, lr_guard = self._health_checks(train, strategy, job=state["health"] is not None)
        if lr_guard is not None:
            parts["lr_guard"] = lr_guard
        self._health, self._lr_guard = health, lr_guard
        for name, part in parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        if health is not None and state["health"] is not None:
            health.load_state_dict(state["health"])
        if lr_guard is not None and state["lr_guard_good"] is not None:
            lr_guard.resume(lr_guard.best_loss, state["lr_guard_good"])
        strategy.comm_bytes = 0  # this worker's own bytes count from here (rank 0's stay rank 0's)
        torch.manual_seed(self.seed + me)  # dropout and friends: this worker's own, reproducibly
        self.recorder.job_world = state["job_world"]
        train_model = self._take(group)
        self.recorder.replace_history(state["history"])
        return epoch, state["step"], train_model

    def _snapshot(self, parts: dict, step: int, position: Optional[dict] = None) -> dict:
        """This rank's state now, in memory (what a checkpoint holds), to return to after a membership change;
        `position`: where within the epoch it stands (a commit's), as a checkpoint within an epoch says it."""
        return {"step": step, "rng": checkpoint_files.rng_state(), "history": list(self.recorder.history),
                "position": position,
                **{name: copy.deepcopy(part.state_dict()) for name, part in parts.items() if part is not None}}

    def _keep(self, at: tuple[int, int], step: int, position: Optional[dict]) -> None:
        """Keep this rank's state at `at` (epoch, steps of it done) and the one before only: a rank may have
        passed the collective another failed in, and it continues from the one before then (`regroup`). States
        after `at` (a rank that had gone further, going back to `at` with the others) are dropped."""
        snapshots = self._snapshots
        before = max((key for key in snapshots if key < at), default=None)
        for key in [key for key in snapshots if key != before]:
            del snapshots[key]
        snapshots[at] = self._snapshot(self._parts, step, position)

    def _commit(self, epoch: int, done: int, total: int, step: int, seen: int, loss_sum, epoch_start: float) -> None:
        """Every `commit_every_steps` steps within an epoch (allreduce, `min_workers`): this rank's state, in
        memory, for the survivors to go on from if a worker is lost later in the epoch."""
        if not self._commits or done % self._commits or done >= total:
            return
        position = {"steps": done, "samples": seen, "loss_sum": torch.as_tensor(loss_sum).detach().cpu(),
                    "seconds": time.perf_counter() - epoch_start, "rng": checkpoint_files.rng_state()}
        self._keep((epoch, done), step, position)

    def _rest_steps(self, epoch: int) -> Optional[int]:
        """The steps left of `epoch` in the rest the workers go on with after a commit, or None."""
        rest = self._rest
        return rest.steps if rest is not None and rest.epoch == epoch and rest.done else None

    def _continue_without(self, failure: PeerFailure, parts: dict, train: Dataset) -> tuple[Membership, nn.Module]:
        """After a peer failed: agree with the survivors on who is left and where to continue
        (dptrain.runtime.membership), return to this rank's state from then and take its new rank (and the
        module to train in the new group). From a commit within an epoch, the rest of that epoch's rows (every
        row no worker had read by then) is shared over the survivors (`_rest`)."""
        ctx = self.ctx
        self.recorder.log(f"dptrain: {failure}; the workers left agree on who they are")
        # Where this rank stands (the epoch it failed in, at its start or latest commit); the survivors continue
        # from the earliest of theirs (one of them may have passed the collective another failed in: it keeps
        # the state before too).
        epoch, done = max(self._snapshots)
        before = tuple(ctx.group.members)
        group, membership = regroup(ctx.group, ctx.group.generation + 1, epoch, step=done,
                                    min_workers=self.min_workers, timeout=self.timeout)
        saved = self._snapshots[(membership.epoch, membership.step)]
        if membership.step:
            rest = self._rest
            if rest is None or rest.epoch != membership.epoch or rest.members != before:
                rest = Rest.whole(membership.epoch, len(train), before, self.batch_size, self.seed, self.shuffle,
                                  getattr(train, "block_size", None))
            self._rest = rest.after(membership.step, membership.members, self.batch_size)
            membership = replace(membership, rows_lost=self._rest.read_by(membership.left))
        else:
            self._rest = None
        for name, part in parts.items():
            if part is not None:
                part.load_state_dict(copy.deepcopy(saved[name]))
        checkpoint_files.set_rng_state(saved["rng"])
        self.model.zero_grad(set_to_none=True)  # a backward pass the failure broke may have left gradients
        if len(self.recorder.history) != len(saved["history"]):
            self.recorder.replace_history(saved["history"])
        train_model = self._take(group)
        within = (f" at step {membership.step} of it (its last commit; the rest of its rows shared over them)"
                  if membership.step else "")
        self.recorder.log(f"dptrain: continuing from epoch {membership.epoch + 1}{within} with "
                          f"{_workers(group.world_size)} ({_ranks(membership.members)} of the job; without "
                          f"{_ranks(membership.left)})")
        return membership, train_model

    def _train_epoch(self, model: nn.Module, reader: DataLoader, epoch: int, epochs: int, step: int,
                     scheduler, position: Optional[dict] = None) -> tuple[int, Union[float, torch.Tensor], int]:
        """One epoch of steps with the strategy's per-step hooks: (samples, loss sum, step count).

        `position`: the checkpoint within this epoch the run resumes from (the reader starts after it)."""
        training = self.strategy.trains_in_epoch(epoch)
        model.train()
        loss_sum, seen, done = 0.0, 0, 0  # done: steps of this epoch so far
        if position is not None:
            loss_sum, seen, done = position["loss_sum"].to(self.ctx.device), position["samples"], position["steps"]
        epoch_start = time.perf_counter() - (position["seconds"] if position else 0.0)
        bar = self.recorder.progress_bar(len(reader) if training else 0, epoch, epochs)
        batches = iter(reader) if training else iter(())
        if position is not None:  # starting the reader drew a seed from torch's RNG: back to the saved state
            checkpoint_files.set_rng_state(position["rng"])
        faults.at(self.ctx.job_rank, epoch + 1)
        total = done + (len(reader) if training else 0)  # the epoch's steps
        middle = (len(reader) // 2 if training else -1) - done
        for index, (x, y) in enumerate(batches):
            if index == middle:
                faults.point("train-middle")
            loss = self._train_step(model, x, y)
            if self.step_delay is not None:  # straggler emulation: `factor` times its own compute, not its waits
                time.sleep(self.step_delay.seconds(len(y)))
            step += 1
            if scheduler is not None:
                scheduler.step()
            self.ctx.group.bounded("after_step", lambda: self.strategy.after_step(step))
            loss_sum = loss_sum + loss * len(y)  # a tensor: no device sync per step
            seen += len(y)
            done += 1
            if self.recorder.show_progress:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            faults.step(self.ctx.job_rank, step)
            self._checkpoint_within(epoch, done, step, seen, loss_sum, epoch_start)
            self._commit(epoch, done, total, step, seen, loss_sum, epoch_start)
        if not training:  # a worker that sits the epoch out still takes its part in the epoch's checkpoints
            for steps in range(done + 1, self._common_steps):
                self._checkpoint_within(epoch, steps, step, seen, loss_sum, epoch_start)
        bar.close()
        return seen, loss_sum, step

    def _checkpoint_within(self, epoch: int, done: int, step: int, seen: int, loss_sum: Union[float, torch.Tensor],
                           epoch_start: float) -> None:
        """The checkpoint `done` steps into epoch `epoch` (from 0) when one is due there; a stop signal is obeyed
        here (every rank passes the same points, even one that sits the epoch out)."""
        if not self.checkpointer.due_within(done, self._common_steps):
            return
        stop = self.strategy.agree_stop(self.stop_signals.requested)
        now = time.perf_counter()
        position = {"steps": done, "samples": seen, "loss_sum": torch.as_tensor(loss_sum).detach().cpu(),
                    "seconds": now - epoch_start,
                    "health": self._health.state_dict() if self._health is not None else {},
                    "lr_guard": ({"best_loss": self._lr_guard.best_loss, "good": self._lr_guard.good_state()}
                                 if self._lr_guard is not None else {})}
        self.checkpointer.save(epoch, step, now - self._started, self._parts, self.recorder.history, position,
                               members=self._members())
        if stop:
            where = checkpoint_files.describe(checkpoint_files.named(epoch, done))
            self.ctx.group.bounded("checkpoint before stopping", self.strategy.stop_together)
            self.checkpointer.prune()
            raise Preempted(f"rank {self.ctx.rank}: stopped by {stop} at {where}; a checkpoint is saved "
                            f"in {self.out}: run the same command again to continue")

    def _resume_checks(self, position: dict) -> None:
        """The check of averages and the LR guard as they stood at a checkpoint within an epoch."""
        if self._health is not None and position["health"]:
            self._health.load_state_dict(position["health"])
        if self._lr_guard is not None and position["lr_guard"]:
            self._lr_guard.resume(position["lr_guard"]["best_loss"], position["lr_guard"]["good"])

    def _health_checks(self, train: Dataset, strategy: Strategy,
                       job: bool = False) -> tuple[Optional[AverageHealth], Optional[LRGuard]]:
        """The check of every average, when the strategy averages at epoch ends on more than one worker (with
        `job`, whatever the world now: a joiner's, as the job's workers made theirs), and the guard of a scaled LR
        (dptrain.train.health)."""
        if not self.check_averages or (self.ctx.world_size == 1 and not job) or strategy.average_check is None:
            return None, None
        log = self.recorder.log if strategy.average_check == "together" else self._rank_log
        health = AverageHealth(self.ctx, train, self.loss_fn, self.classify, strategy.average_check == "together",
                               self.seed, log)
        lr_guard = (LRGuard(self.lr_scale, strategy.restores_average(), log) if self.lr_scale > 1 else None)
        return health, lr_guard

    def _rank_log(self, message: str) -> None:
        """A line about this rank alone (async's merges): said by that rank (launchers prefix its rank)."""
        if self.verbose:
            print(message, flush=True)

    def _check_average(self, health: AverageHealth, lr_guard: Optional[LRGuard], epoch: int, trained: bool,
                       scheduler) -> dict:
        """Measure the average this epoch end made; say when averaging collapses; let the LR guard act.
        Returns what metrics.jsonl records about it."""
        check = health.after(self.model, epoch, trained)
        checked: dict = {"average_check": check.record()}
        line = health.verdict(check)
        if line is not None:
            health.log(line)
            checked["collapse"] = line.removeprefix("dptrain: ")
        if lr_guard is not None:
            backoff = lr_guard.judge(check, self.model, self.optimizer, scheduler)
            if backoff is not None:
                checked["lr_backoff"] = backoff
        return checked

    def _recover_or_check(self, model: nn.Module, epoch: int, train_loss: float, lr_guard: Optional[LRGuard],
                          scheduler) -> Optional[dict]:
        """Divergence in an epoch (weights not finite, or a training loss 10x the first epoch's): under a scaled
        LR that the guard can take back (ranks that average together, the last good average kept), every rank
        returns to that average with half the scale, and this returns what happened; else the run stops."""
        if lr_guard is None or not lr_guard.can_recover or self.strategy.average_check != "together":
            self._check_finite(model, epoch, train_loss)
            return None
        history = self.recorder.history
        first = history[0]["train_loss"] if history else math.nan
        diverged = not self._finite(model) or not math.isfinite(train_loss) or _grew(train_loss, first)
        if not self.ctx.group.any_rank("divergence check", diverged):
            return None
        return lr_guard.recover(epoch + 1, self.model, self.optimizer, scheduler)

    @staticmethod
    def _finite(model: nn.Module) -> bool:
        finite = [torch.isfinite(p).all() for p in model.parameters()]
        return not finite or bool(torch.stack(finite).all())  # one device sync, not one a tensor

    def _check_loss_growth(self, epoch: int) -> None:
        """Stop a run whose training loss (over the workers) became 10x its first epoch's: it diverges even
        when the weights are still finite."""
        history = self.recorder.history
        first, last = history[0]["train_loss"], history[-1]["train_loss"]
        if len(history) > 1 and _grew(last, first):
            raise Diverged(f"rank {self.ctx.rank}: training diverged in epoch {epoch + 1}: the training loss "
                           f"{last:.4g} is more than {LOSS_GROWTH_LIMIT:g}x the first epoch's {first:.4g}; "
                           "lower --lr (or --lr-scaling none), clip gradients (--grad-clip) or warm up (--warmup-epochs)")

    def _check_finite(self, model: nn.Module, epoch: int, loss: float) -> None:
        """Stop a run whose weights became NaN or infinite (they never recover, and an average would spread
        them to every replica): one line naming the rank and epoch; earlier checkpoints stay."""
        if self._finite(model):
            return
        before = next((f"; the epoch before, it was {r['train_loss']:.4g}" for r in reversed(self.recorder.history)
                       if math.isfinite(r["train_loss"])), "")
        raise Diverged(f"rank {self.ctx.rank}: training diverged in epoch {epoch + 1}: the weights became NaN or "
                       f"infinite (training loss {loss:.4g}{before}); lower --lr, clip gradients (--grad-clip) or "
                       "warm up (--warmup-epochs)")

    def _train_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = self.ctx.device
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        dtype = AMP_DTYPES[self.amp]
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            output = self._forward(model, x)
            loss = self.loss_fn(output.float(), y)
        scaled = self.scaler.scale(loss) if self.scaler else loss
        self.ctx.group.bounded("backward", scaled.backward, communication_failed=self.strategy.communication_failed)
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

    def timing_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> None:
        """One plain step of `model` with `optimizer` on (x, y), in this trainer's precision and loss, without
        communication, loss scaling or clipping: what --strategy auto times (dptrain.strategies.auto)."""
        device = self.ctx.device
        inputs, targets = x.to(device), y.to(device)
        dtype = AMP_DTYPES[self.amp]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = self.loss_fn(model(inputs).float(), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`model(x)`. DistributedDataParallel communicates before it calls the user's module (the bucket
        order after the first step, buffers): an error raised before the user's forward was entered is a
        peer's (one line naming it), one raised inside it keeps its traceback."""
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return model(x)
        if self._forward_mark is None or self._forward_mark[0] is not model:
            if self._forward_mark is not None:
                self._forward_mark[1].remove()
            self._forward_mark = (model, model.module.register_forward_pre_hook(self._entered_forward))
        self._in_user_forward = False
        return self.ctx.group.bounded("forward", lambda: model(x), communication_failed=lambda: not self._in_user_forward)

    def _entered_forward(self, module: nn.Module, inputs) -> None:
        self._in_user_forward = True

    def _restore(self, parts: dict, train: Dataset) -> tuple[int, int, float, Optional[dict]]:
        """Continue from the newest complete checkpoint, if any: (epoch, step, wall seconds) to start from, and
        the position within that epoch (None at its start). Written by another number of workers than this world
        has (`_resized`: that number), a checkpoint within an epoch has the rest of that epoch planned over this
        world (`_rest`): every row no writer had read, once."""
        self._resized = None
        state = self.checkpointer.restore(parts)
        if state is None:
            if self.out is not None and (self.out / "metrics.jsonl").exists():
                self.recorder.replace_history([])  # the run starts over: its epochs will be recorded again
            return 0, 0, 0.0, None
        self.recorder.replace_history(state["history"])  # metrics after the checkpoint belong to the lost attempt
        if state["copy"]:  # a worker new to the run: the bytes of the one whose state it copies stay that one's
            self.strategy.comm_bytes = 0
        members, position = state["members"], state.get("position")
        if members != list(self.ctx.group.members):
            self.recorder.resume_without(min(len(members), self.ctx.world_size))
        if len(members) != self.ctx.world_size:
            self._resized = len(members)
            if position:  # (a checkpoint within an epoch is never taken after rows were shared out again)
                rest = Rest.whole(state["epoch"], len(train), members, self.batch_size, self.seed, self.shuffle,
                                  getattr(train, "block_size", None))
                self._rest = rest.after(position["steps"], tuple(self.ctx.group.members), self.batch_size)
        # a copy draws its own random numbers within the epoch too (its source's stay its source's)
        position = {**position, "rng": checkpoint_files.rng_state() if state["copy"] else state["rng"]} if position else None
        return state["epoch"], state["step"], state["wall_seconds"], position

    # -- evaluation and the summary ------------------------------------------------------------
    def _evaluate_global(self, test: Dataset) -> Optional[dict]:
        module, collective = self.strategy.evaluation_target()
        if module is None:
            return None
        return self.evaluate(module, test, collective=collective)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: TrainData, collective: bool = True) -> dict:
        """Loss and accuracy of `model` over the whole test split (accuracy None for float targets).

        Collectively (the model is the same on every rank): each rank evaluates its slice and
        three numbers are summed across ranks (metric traffic, not counted in comm_bytes).
        Otherwise this rank evaluates all of it alone.
        """
        rank, world = (self.ctx.rank, self.ctx.world_size) if collective else (0, 1)
        was_training = model.training
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        classify = True
        for x, y in self._evaluation_batches(test, rank, world):
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            output = model(x).float()
            totals[0] += self.loss_fn(output, y).item() * len(y)
            classify = self.classify if self.classify is not None else not y.is_floating_point()
            if classify:
                totals[1] += (output.argmax(dim=1) == y.long()).sum().item()
            totals[2] += len(y)
        model.train(was_training)
        if world > 1:
            totals = self.ctx.group.sum_tensor("evaluate", totals)
        count = max(totals[2].item(), 1.0)
        return {"test_loss": totals[0].item() / count,
                "test_accuracy": totals[1].item() / count if classify else None}

    def _evaluation_batches(self, test: TrainData, rank: int, world: int) -> DataLoader:
        """The DataLoader of this rank's part of `test`, made once (its worker processes persist)."""
        # One at a time (fit evaluates one test set), holding `test` itself so its identity is never reused.
        made = self._evaluation
        if made is None or made[0] is not test or made[1] != (rank, world):
            made = self._evaluation = (test, (rank, world), evaluation_loader(
                as_dataset(test, "test"), rank, world, EVAL_BATCH, self.loader_workers))
        return made[2]

    def _summarise(self, final: nn.Module, epochs: int, wall: float, test: Optional[dict]) -> Summary:
        workers = self.strategy.workers_history(self.recorder.history)
        if workers is not None:
            self.recorder.complete(workers)
        comm = self.ctx.group.gather_objects("summary", self.strategy.comm_bytes)
        summary = Summary(
            strategy=self.strategy.name, workers=self.ctx.world_size,
            strategy_options={**self.strategy.describe(), **({"auto": self.strategy_choice} if self.strategy_choice else {})},
            epochs=epochs, test_accuracy=test["test_accuracy"] if test else None,
            test_loss=test["test_loss"] if test else None, wall_seconds=wall,
            samples_per_second=self.recorder.samples() / max(wall, 1e-9),
            comm_bytes=sum(comm) + self.recorder.departed_bytes,
            comm_bytes_per_worker=comm, model_parameters=sum(p.numel() for p in final.parameters()),
            backend=self.ctx.backend, device=str(self.ctx.device), launcher=self.ctx.launcher, seed=self.seed,
            strategy_results=self.strategy.summary(), data=self.data_record)
        self.recorder.write_final(summary, final)
        return summary
