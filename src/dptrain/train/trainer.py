"""The one training loop, for every strategy: plan the epoch, step, let the strategy communicate, evaluate, record.

    trainer = Trainer(model, optimizer, "cross-entropy", Sync(every=1), batch_size=32)
    summary = trainer.fit((x_train, y_train), (x_test, y_test), epochs=10)

Under a launcher (dptrain's own, torchrun, srun, mpirun) every rank runs this same code; in a
plain `python script.py` it trains as one worker. The loop composes its parts, each tested on its
own: the epoch plan (dptrain.data.sampler), the strategy's hooks (dptrain.strategies.base), the
step (step.py), who trains (live.py: fixed, or live membership), the checks around the averages
(checks.py), the checkpointer, the recorder, evaluation and the summary (evaluation.py) and the
stop signals; the state they share is one TrainState (state.py).
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from dptrain import faults
from dptrain.data.fingerprint import fingerprint
from dptrain.data.sampler import TrainData, check_known_labels
from dptrain.errors import Diverged, Interrupted, Preempted, UserError, install_excepthook
from dptrain.runtime.distributed import DistContext, init_process_group
from dptrain.runtime.env import detect, launcher_reports_interrupts
from dptrain.runtime.group import PeerFailure
from dptrain.strategies.base import Strategy
from dptrain.strategies.rules import step_checkpoints_refused
from dptrain.train import checkpoint_files
from dptrain.train.api_checks import check_trainer_arguments, fit_data
from dptrain.train.checkpointer import Checkpointer, describe_interruption
from dptrain.train.checks import Checks
from dptrain.train.evaluation import EVAL_BATCH, Evaluator, summarise  # noqa: F401 - EVAL_BATCH, for callers
from dptrain.train.live import membership_for, scale_lr
from dptrain.train.loggers import Loggers
from dptrain.train.make_up import after_finish
from dptrain.train.preemption import StopSignals
from dptrain.train.planner import Planner
from dptrain.train.recorder import EpochStats, Recorder, Summary
from dptrain.train.rundir import open_for_trainer
from dptrain.train.state import Position, TrainState, options_from
from dptrain.train.step import AMP_DTYPES, LossFn, Stepper, check_amp, make_loss, timing_step  # noqa: F401
from dptrain.train.straggler import StepDelay, measure_delay

Schedule = Callable[[torch.optim.Optimizer, int, int], object]


@dataclass
class EpochDone:
    """What one epoch gave, up to the ranks' last meeting in it: every worker's numbers, the global model's
    evaluation (None: none), what the checks found, the LR guard's recovery (None: none), the stop obeyed."""

    stats: list
    test: Optional[dict]
    checked: dict
    recovered: Optional[dict]
    stop: Optional[str]


class Trainer:
    """Data-parallel training of `model` with `optimizer` (built by you, on the model's parameters).

    `strategy` defaults to AllReduce (per-step gradient all-reduce). The options come in groups (dptrain.train.state:
    `run`, `step`, `checkpoints`, `checks`, `membership`), or as the keywords they hold (also `shard="full"`: --shard):
    `schedule(optimizer, steps_per_epoch, epochs)` may return an LR scheduler stepped once per step. With
    `out`, the run directory receives metrics.jsonl, summary.json, model.pt and, every `checkpoint_every` epochs
    (and every `checkpoint_every_steps` steps within an epoch), checkpoints (`resume=True` continues from the
    newest, bit for bit; on another number of workers where the strategy can, and never from another run's or
    one trained on other data, unless `resume_with_changed_data`). Nothing joins a process group before `fit`.
    With `min_workers`, the run goes on without failed or departed workers down to that many, and workers
    joining it (`dptrain join`) enter while fewer than `max_workers` train (default: the world it started
    with); `lr_rule(W)` (the factor your LR rule gives W workers) then has the LR follow the live world. With
    `commit_every_steps` too, a strategy whose workers meet at every step (allreduce) keeps its state every that
    many steps in memory, and the survivors go on from the latest such commit they all hold, the rest of that
    epoch's rows shared over them, instead of from the epoch's start.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: Union[str, LossFn] = "cross-entropy",
                 strategy: Optional[Strategy] = None, *, run=None, step=None, checkpoints=None, checks=None,
                 membership=None, **keywords) -> None:
        given = options_from({"run": run, "step": step, "checkpoints": checkpoints, "checks": checks,
                              "membership": membership}, keywords)
        self.run, self.steps, self.checkpoints = given["run"], given["step"], given["checkpoints"]
        self.check_options, self.membership, self.sharding = given["checks"], given["membership"], given["sharding"]
        check_trainer_arguments(model, optimizer, loss, strategy, self.steps.amp)  # a mistake: one line
        if strategy is None:
            from dptrain.strategies.allreduce import AllReduce
            strategy = AllReduce()
        self.model, self.optimizer, self.loss_fn, self.strategy = model, optimizer, make_loss(loss), strategy
        # Accuracy is measured for a classification loss; for a loss of your own, when targets are integers.
        self.classify: Optional[bool] = {"cross-entropy": True, "mse": False}.get(loss) if isinstance(loss, str) else None
        self.strategy_choice: Optional[dict] = None  # how --strategy auto chose (summary.json's strategy_options.auto)
        self.data_record: Optional[dict] = None  # what the data was, for summary.json (set by `dptrain train`)
        self.stop_signals = StopSignals()
        self._slowdown = 1.0
        self.step_delay: Optional[StepDelay] = None  # --slow-worker: measured before training (train.straggler)

    # The settings strategies and callers read (auto also sets the schedule and the LR scale it chose).
    out = property(lambda self: Path(self.run.out) if self.run.out else None)
    resume = property(lambda self: self.checkpoints.resume)
    batch_size = property(lambda self: self.steps.batch_size)
    step_batch = property(lambda self: self.steps.batch_size * self.steps.accumulate)  # the rows of one step
    seed = property(lambda self: self.run.seed)
    schedule = property(lambda self: self.steps.schedule, lambda self, value: setattr(self.steps, "schedule", value))
    lr_scale = property(lambda self: self.check_options.lr_scale,
                        lambda self, value: setattr(self.check_options, "lr_scale", value))

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
        run, checkpoints = self.run, self.checkpoints
        self.ctx = ctx = init_process_group(detect(), device=run.device, timeout=run.timeout)
        install_excepthook()  # over torch's, which init_process_group put over ours (buffering what it prints)
        open_for_trainer(self.out, checkpoints.resume, ctx, self._held)  # dptrain train's rules; locked until fit ends
        check_amp(self.steps.amp, ctx.device)
        self.stepper = Stepper(ctx, self.loss_fn, self.steps.amp, self.steps.grad_clip, self.optimizer, self.steps.accumulate)
        self.model = self.model.to(ctx.device)
        self.recorder = Recorder(self.out, ctx.writes_results, run.verbose, run.progress, ctx.world_size,
                                 loggers=Loggers.of_run(run, self.strategy, ctx.world_size, self.batch_size, self.optimizer))
        self.checkpointer = Checkpointer(self.out, ctx, checkpoints, self.recorder.log)
        self.evaluator = Evaluator(ctx, self.loss_fn, self.classify, run.loader_workers, self.batch_size, self.steps.amp)
        self.live = membership_for(ctx, self.recorder, self.membership, timeout=run.timeout, seed=run.seed,
                                   out=self.out, batch_size=self.step_batch, whole_epoch=lambda epoch, members: self.planner.whole_epoch(epoch, members),
                                   forget_model=self.stepper.forget_model)
        return ctx

    # -- the loop -----------------------------------------------------------------------
    def fit(self, train: TrainData, test: Optional[TrainData] = None, epochs: int = 1) -> Summary:
        """Train for `epochs` on `train` ((x, y) arrays, tensors or DSTensors, or a torch Dataset of (x, y)
        items); evaluate on `test` after each epoch; return the Summary (also written to OUT/summary.json).

        Ctrl-C raises Interrupted, saying after which epoch and what the same command would do again."""
        train, test = fit_data(train, test, self.strategy, self.membership)
        if self.classify and self.data_record is None:  # (`dptrain train` checked its data itself)
            check_known_labels(train, test, print if os.environ.get("RANK", "0") == "0" else lambda line: None)
        try:
            with ExitStack() as self._held:  # the run directory's lock (rank 0 takes it in _connect)
                return self._fit(train, test, epochs)
        except KeyboardInterrupt:
            ctx = getattr(self, "ctx", None)
            # dptrain's own launchers stop every rank and say it once; elsewhere rank 0 says it.
            said_elsewhere = launcher_reports_interrupts() or ctx is None or not ctx.is_main
            raise Interrupted("" if said_elsewhere else describe_interruption(
                self.out, ctx.world_size, len(self.history), epochs)) from None

    def _fit(self, train: TrainData, test: Optional[TrainData], epochs: int) -> Summary:
        self._connect()  # (fit made train and test Datasets already)
        state = self._prepare(train, epochs)
        wall_before = self._begin(state, epochs)
        self.stop_signals.watch()
        self._started = time.perf_counter() - wall_before
        evaluated = stopped = False  # whether the last epoch evaluated the global model; stopped early
        while state.epoch < epochs and not stopped:
            if self.live.epoch_begins(state):
                self.planner.replan(state, epochs)
            try:
                done = self._epoch(state, test, epochs)
            except PeerFailure as failure:
                self.live.failed(failure, state)  # re-raised, unless the run goes on without the lost
                self.planner.replan(state, epochs)
                continue
            evaluated = done.test is not None
            stopped = self._conclude(state, done, epochs)
            if self.live.epoch_ended(state, epochs):
                self.planner.replan(state, epochs, state.epoch + 1)
            state.epoch += 1
        return self._finish(test, state.epoch if stopped else epochs, evaluated)

    def _prepare(self, train, epochs: int) -> TrainState:
        """The strategy (auto measures and picks one), the first epoch plan and schedule, the strategy's model."""
        ctx = self.ctx
        self.strategy.shard_as(self.sharding)  # before the plan and auto's choice (auto has no sharded form)
        strategy, self.strategy_choice = self.strategy.resolve(self, train)
        self.strategy = self.stepper.strategy = strategy
        if self._slowdown > 1:  # before the strategy wraps the model: timed without any communication
            self.step_delay = measure_delay(self._slowdown, self.timing_step, self.model, self.optimizer, ctx,
                                            self.batch_size, train)
        if self.checkpoints.every_steps and strategy.no_step_checkpoints:
            raise UserError(step_checkpoints_refused(strategy.name, strategy.no_step_checkpoints))
        self.live.bind(strategy, chosen=self.strategy_choice is not None)
        self._train = train
        self.checkpointer.identify(strategy, lambda: fingerprint(train))
        self.planner = Planner(ctx, strategy, train, self.recorder.log, batch_size=self.step_batch, seed=self.seed,
                               shuffle=self.run.shuffle, loader_workers=self.run.loader_workers,
                               checkpoint_every_steps=self.checkpoints.every_steps, schedule=self.schedule)
        plan = self.planner.plan(None)
        scheduler = self.schedule(self.optimizer, plan.steps, epochs) if self.schedule else None
        torch.manual_seed(self.seed + ctx.rank)  # dropout and friends differ per worker, reproducibly
        module = ctx.group.bounded("setup", lambda: strategy.setup(self.model, self.optimizer, ctx))
        return TrainState(self.model, self.optimizer, strategy, self._make_checks(), scheduler, self.stepper.scaler,
                          module)

    def _begin(self, state: TrainState, epochs: int) -> float:
        """Where the run starts: a joiner from a live peer's state, a resume from the newest complete checkpoint,
        else from nothing. Returns the wall seconds the run had taken before."""
        if self.live.from_peer:
            self.live.start_from_peer(state, self._make_checks)
            self.planner.replan(state, epochs)
            return 0.0
        wall = self._restore(state, epochs) if self.resume else 0.0
        if state.position is not None:  # within an epoch: the checks go on as they were
            state.checks.resume(state.position.checks)
        else:
            state.checks.start(self.model)
        return wall

    def _make_checks(self, job: bool = False) -> Checks:
        return Checks(self.ctx, self._train, self.strategy, self.loss_fn, self.classify, self.seed,
                      check_averages=self.check_options.check_averages, lr_scale=self.lr_scale,
                      log=self.recorder.log, rank_log=self._rank_log, job=job)

    def _epoch(self, state: TrainState, test, epochs: int) -> EpochDone:
        """One epoch up to the ranks' last meeting in it (its stats gathered, the stop agreed); nothing written.
        It starts from `state.position` (a checkpoint's or a commit's within it) when there is one."""
        ctx, strategy, epoch, position = self.ctx, self.strategy, state.epoch, state.position
        state.position = None
        epoch_start = time.perf_counter() - (position.seconds if position else 0.0)
        self.planner.batches.set_epoch(epoch, position.steps if position else 0)
        samples, loss_sum = self._train_epoch(state, epochs, position)
        train_loss = float(loss_sum) / max(samples, 1)
        recovered = state.checks.recover_or_check(state.module, self.model, epoch, train_loss, self.history,
                                                  self.optimizer, state.scheduler)
        trained, averages = strategy.trains_in_epoch(epoch), strategy.averaging_events()
        state.checks.before_average(self.model, trained)
        is_global = ctx.group.bounded("end_epoch", lambda: strategy.end_epoch(epoch))
        checked = {}
        if state.checks.health is not None and strategy.averaging_events() > averages:
            checked = state.checks.after_average(self.model, epoch, trained, self.optimizer, state.scheduler)
        stats = EpochStats(ctx.rank, samples, train_loss, time.perf_counter() - epoch_start, strategy.comm_bytes)
        test_metrics = self.evaluator.of_strategy(strategy, test) if (test is not None and is_global) else None
        gathered = strategy.gather_stats(stats)
        stop = self.live.agree_stop(self.stop_signals.requested) if self.checkpointer.enabled else None
        return EpochDone(gathered, test_metrics, checked, recovered, stop)

    def _train_epoch(self, state: TrainState, epochs: int, position: Optional[Position]):
        """One epoch of steps with the strategy's per-step hooks: (samples, loss sum); `state.step` counts on.
        `position`: where within this epoch it starts (the reader starts after it)."""
        epoch, reader, ctx = state.epoch, self.planner.reader, self.ctx
        training = self.strategy.trains_in_epoch(epoch)
        state.module.train()
        loss_sum, seen, done = 0.0, 0, 0  # done: steps of this epoch so far
        if position is not None:
            loss_sum, seen, done = position.loss_sum.to(ctx.device), position.samples, position.steps
        epoch_start = time.perf_counter() - (position.seconds if position else 0.0)
        bar = self.recorder.progress_bar(len(reader) if training else 0, epoch, epochs)
        batches = iter(reader) if training else iter(())
        if position is not None:  # starting the reader drew a seed from torch's RNG: back to the saved state
            checkpoint_files.set_rng_state(position.rng)
        faults.at(ctx.job_rank, epoch + 1)
        total = done + (len(reader) if training else 0)  # the epoch's steps
        middle = (len(reader) // 2 if training else -1) - done
        for index, (x, y) in enumerate(batches):
            if index == middle:
                faults.point("train-middle")
            loss = self.stepper.step(state.module, x, y)
            if self.step_delay is not None:  # straggler emulation: `factor` times its own compute, not its waits
                time.sleep(self.step_delay.seconds(len(y)))
            state.step += 1
            if state.scheduler is not None:
                state.scheduler.step()
            ctx.group.bounded("after_step", lambda: self.strategy.after_step(state.step))
            loss_sum, seen, done = loss_sum + loss * len(y), seen + len(y), done + 1  # no device sync per step
            if self.recorder.show_progress:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            faults.step(ctx.job_rank, state.step)
            self._checkpoint_within(state, done, seen, loss_sum, epoch_start)
            self.live.step_done(state, done, total, seen, loss_sum, epoch_start)
        if not training:  # a worker that sits the epoch out still takes its part in the epoch's checkpoints
            for steps in range(done + 1, self.planner.common_steps):
                self._checkpoint_within(state, steps, seen, loss_sum, epoch_start)
        bar.close()
        return seen, loss_sum

    def _conclude(self, state: TrainState, done: EpochDone, epochs: int) -> bool:
        """The epoch's record, checks, best model and checkpoint, an agreed stop; whether to stop early here."""
        ctx, epoch = self.ctx, state.epoch
        self.live.lead()
        checked = done.checked if done.recovered is None else {**done.checked, "lr_backoff": done.recovered}
        checked = {**checked, **self.live.note()}
        self.recorder.record(epoch, epochs, done.stats, done.test, time.perf_counter() - self._started,
                             self.optimizer.param_groups[0]["lr"], checked)
        if checked.get("collapse") and self.check_options.stop_on_collapse:
            raise Diverged(f"rank {ctx.rank}: stopped by --stop-on-collapse: {checked['collapse']}")
        if done.recovered is None:
            state.checks.check_loss_growth(epoch, self.history)
        if done.stop or self.checkpointer.due(epoch + 1):
            self.checkpointer.save(epoch + 1, state.step, time.perf_counter() - self._started, state.parts(),
                                   self.history, members=self._members())
        if done.stop:
            ctx.group.bounded("checkpoint before stopping", self.strategy.stop_together)
            self.checkpointer.prune()  # every rank's file of the last checkpoint is written now
            raise Preempted(f"rank {ctx.rank}: stopped by {done.stop} after epoch {epoch + 1}; a checkpoint is saved "
                            f"in {self.out}: run the same command again to continue")
        return self.checkpointer.best.epoch_ended(self.history, self.strategy)

    def _finish(self, test, epochs: int, evaluated: bool) -> Summary:
        """The final model (after any last communication), its evaluation, the summary."""
        ctx = self.ctx
        self.live.end()
        final = ctx.group.bounded("finish", self.strategy.finish)
        self.live.lead()
        evaluated = not after_finish(self, final, epochs) and evaluated  # the workers left: rows to make up
        wall = time.perf_counter() - self._started
        final_metrics = None
        if test is not None:
            # Reuse the last epoch's evaluation when it was of this very model (not when this
            # attempt resumed after the last epoch and trained nothing, nor when others merged later).
            reuse = evaluated and self.strategy.final_model_is_last_evaluated
            final_metrics = self.recorder.last_evaluation() if reuse else self.evaluate(final, test)
        summary = summarise(self, final, epochs, wall, final_metrics)
        self.checkpointer.prune()  # the summary's gather came after every rank's last save
        return summary

    # -- checkpoints ---------------------------------------------------------------------------
    def _members(self) -> tuple[int, ...]:
        """The ranks of the job training now (async: those live, over a group that stays the job's)."""
        now = self.strategy.members_now()
        if now is not None:
            return now
        return self.recorder.members if self.recorder.members is not None else tuple(self.ctx.group.members)

    def _checkpoint_within(self, state: TrainState, done: int, seen: int, loss_sum: Union[float, torch.Tensor],
                           epoch_start: float) -> None:
        """The checkpoint `done` steps into the state's epoch when one is due there; a stop signal is obeyed
        here (every rank passes the same points, even one that sits the epoch out)."""
        if not self.checkpointer.due_within(done, self.planner.common_steps):
            return
        stop = self.strategy.agree_stop(self.stop_signals.requested)
        now = time.perf_counter()
        position = Position(done, seen, torch.as_tensor(loss_sum).detach().cpu(), now - epoch_start,
                            checks=state.checks.position(), plan=self.planner.lineage(state.rest, state.epoch))
        self.checkpointer.save(state.epoch, state.step, now - self._started, state.parts(), self.history,
                               position.saved(), members=self._members())
        if stop:
            where = checkpoint_files.describe(checkpoint_files.named(state.epoch, done))
            self.ctx.group.bounded("checkpoint before stopping", self.strategy.stop_together)
            self.checkpointer.prune()
            raise Preempted(f"rank {self.ctx.rank}: stopped by {stop} at {where}; a checkpoint is saved "
                            f"in {self.out}: run the same command again to continue")

    def _restore(self, state: TrainState, epochs: int) -> float:
        """Continue from the newest complete checkpoint, if any (the state's epoch, step and position within the
        epoch from it); returns the wall seconds before. Written by another number of workers than this world
        has, its epochs are planned anew, and a checkpoint within an epoch has the rest of that epoch planned over
        this world (`state.rest`): every row no writer had read, once."""
        ctx = self.ctx
        saved = self.checkpointer.restore(state.parts())
        if saved is None:
            if self.out is not None and (self.out / "metrics.jsonl").exists():
                self.recorder.replace_history([])  # the run starts over: its epochs will be recorded again
            return 0.0
        self.recorder.replace_history(saved["history"])  # metrics after the checkpoint belong to the lost attempt
        if saved["copy"]:  # a worker new to the run: the bytes of the one whose state it copies stay that one's
            self.strategy.continue_as_copy()
        members, position = saved["members"], saved.get("position")
        if members != list(ctx.group.members):
            self.recorder.resume_without(min(len(members), ctx.world_size))
        state.rest = self.planner.rest_on_resume(saved) if position else None  # (None: this world's plan reads it)
        # a copy draws its own random numbers within the epoch too (its source's stay its source's)
        rng = checkpoint_files.rng_state() if saved["copy"] else saved["rng"]
        state.position = Position.from_saved(position, rng) if position else None
        state.epoch, state.step = saved["epoch"], saved["step"]
        if len(members) != ctx.world_size:  # on another world than wrote the checkpoint: its epochs planned anew
            scale_lr(self.membership.lr_rule, state, len(members), ctx.world_size, self.recorder.log)
        if len(members) != ctx.world_size or state.rest is not None:
            self.planner.replan(state, epochs)
        return saved["wall_seconds"]

    # -- evaluation and lines --------------------------------------------------------------------
    def evaluate(self, model: nn.Module, test: TrainData, collective: bool = True) -> dict:
        """Loss and accuracy of `model` over the whole test split (dptrain.train.evaluation.Evaluator)."""
        return self.evaluator.evaluate(model, test, collective)

    def timing_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> None:
        """One plain step in this trainer's precision and loss, without communication (dptrain.train.step)."""
        timing_step(self.ctx.device, self.steps.amp, self.loss_fn, model, optimizer, x, y)

    def _rank_log(self, message: str) -> None:
        """A line about this rank alone (async's merges): said by that rank (launchers prefix its rank)."""
        if self.run.verbose:
            print(message, flush=True)
