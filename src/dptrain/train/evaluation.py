"""Evaluation of a model on the test split (collectively: each rank its slice) and the run's summary."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptrain.data.sampler import TrainData, as_dataset, evaluation_loader
from dptrain.data.staging import every_node
from dptrain.runtime.sharded import gathered
from dptrain.train.recorder import Summary
from dptrain.train.step import AMP_DTYPES

EVAL_BATCH = 1024  # the batch of an evaluation whose caller names none (the Trainer's is its training batch)


class Evaluator:
    """Loss and accuracy of a model over the whole test split, on this rank's context."""

    def __init__(self, ctx, loss_fn, classify: Optional[bool], loader_workers: int, batch_size: int = EVAL_BATCH,
                 amp: str = "none") -> None:
        self.ctx, self.loss_fn, self.classify, self.loader_workers = ctx, loss_fn, classify, loader_workers
        self.batch_size, self.dtype = batch_size, AMP_DTYPES[amp]  # as the run trains: no larger batch, its autocast
        self._made: Optional[tuple] = None  # (test set, (rank, world), its DataLoader)

    def of_strategy(self, strategy, test) -> Optional[dict]:
        """The evaluation of the model the strategy says is global now (None: none is)."""
        module, collective = strategy.evaluation_target()
        if module is None:
            return None
        return self.evaluate(module, test, collective=collective)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: TrainData, collective=True) -> dict:
        """Loss and accuracy of `model` over the whole test split (accuracy None for float targets).

        Collectively (the model is the same on every rank): each rank evaluates its slice and
        three numbers are summed across ranks (metric traffic, not counted in comm_bytes); `collective`
        a Group: across its ranks only (a sharded async run's global model, held by replica group 0).
        Otherwise this rank evaluates all of it alone.
        """
        group = self.ctx.group if collective is True else (collective or None)
        rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
        was_training = model.training
        model.eval()
        with gathered(model):  # a sharded model whole: the ranks' slices may differ in batches
            totals, classify = self._totals(model, test, rank, world)
        model.train(was_training)
        if world > 1:
            totals = group.sum_tensor("evaluate", totals)
        count = max(totals[2].item(), 1.0)
        return {"test_loss": totals[0].item() / count,
                "test_accuracy": totals[1].item() / count if classify else None}

    def _totals(self, model: nn.Module, test: TrainData, rank: int, world: int) -> tuple[torch.Tensor, bool]:
        """(loss sum, correct, count) of `model` on this rank's part of `test`; whether it classifies."""
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        classify = True
        for x, y in self._batches(test, rank, world):
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            with torch.autocast(self.ctx.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                output = model(x).float()
            totals[0] += self.loss_fn(output, y).item() * len(y)
            classify = self.classify if self.classify is not None else not y.is_floating_point()
            if classify:
                totals[1] += (output.argmax(dim=1) == y.long()).sum().item()
            totals[2] += len(y)
        return totals, classify

    def _batches(self, test: TrainData, rank: int, world: int) -> DataLoader:
        """The DataLoader of this rank's part of `test`, made once (its worker processes persist)."""
        # One at a time (fit evaluates one test set), holding `test` itself so its identity is never reused.
        made = self._made
        if made is None or made[0] is not test or made[1] != (rank, world):
            made = self._made = (test, (rank, world), evaluation_loader(
                as_dataset(test, "test"), rank, world, self.batch_size, self.loader_workers))
        return made[2]


def summarise(trainer, final: nn.Module, epochs: int, wall: float, test: Optional[dict]) -> Summary:
    """The run's Summary (summary.json), after every rank's last epoch: gathers each worker's bytes."""
    strategy, recorder, ctx = trainer.strategy, trainer.recorder, trainer.ctx
    workers = strategy.workers_history(recorder.history)
    if workers is not None:
        recorder.complete(workers)
    comm = ctx.group.gather_objects("summary", strategy.comm_bytes)
    data = trainer.data_record
    if data is not None and "staging" in data:  # --stage-to: every node's copy, not only this one's
        data = {**data, "staging": every_node(ctx.group, data["staging"])}
    choice = {"auto": trainer.strategy_choice} if trainer.strategy_choice else {}
    summary = Summary(
        strategy=strategy.name, workers=ctx.world_size, strategy_options={**strategy.describe(), **choice},
        epochs=epochs, test_accuracy=test["test_accuracy"] if test else None,
        test_loss=test["test_loss"] if test else None, wall_seconds=wall,
        samples_per_second=recorder.samples() / max(wall, 1e-9),
        comm_bytes=sum(comm) + recorder.departed_bytes,
        comm_bytes_per_worker=comm, model_parameters=sum(p.numel() for p in final.parameters()),
        backend=ctx.backend, device=str(ctx.device), launcher=ctx.launcher, seed=trainer.seed,
        strategy_results=strategy.summary(), data=data)
    recorder.write_final(summary, final)
    return summary
