"""async: merges are commutative, never lost, staleness is bounded, ema follows its formula."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.strategies.asynchronous import Async, GlobalModel, flat_state
from dptrain.train.trainer import Trainer


def test_delta_merges_in_any_order_give_the_mean_of_the_workers():
    rng = np.random.default_rng(0)
    base = torch.from_numpy(rng.normal(size=50).astype(np.float32))
    locals_ = [base + torch.from_numpy(rng.normal(size=50).astype(np.float32)) for _ in range(4)]
    expected = torch.stack(locals_).mean(dim=0)
    for order in itertools.permutations(range(4)):
        model = GlobalModel(base, workers=4)
        for position, rank in enumerate(order):
            _, version, staleness = model.apply(rank, locals_[rank] - base, base_version=0)
            assert staleness == position and version == position + 1
        assert torch.allclose(model.state, expected, atol=1e-6), order
        assert model.merges == [1, 1, 1, 1] and model.max_staleness_seen == 3


def test_ema_merge_is_the_reference_rule_and_halves_the_early_workers():
    base = torch.zeros(3)
    model = GlobalModel(base, workers=4, merge="ema")
    for rank in range(4):
        model.apply(rank, torch.full((3,), float(2 ** rank)), base_version=rank)
    # G = (((0 + 1)/2 + 2)/2 + 4)/2 + 8)/2: worker k is weighted 2^-(W-k)
    expected = 1 / 16 + 2 / 8 + 4 / 4 + 8 / 2
    assert torch.allclose(model.state, torch.full((3,), expected))


# -- real processes ----------------------------------------------------------------------------

def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int64)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


class DelayedAsync(Async):
    """Merges after a rank-specific delay (forcing the merge order) and records what it sent."""

    def __init__(self, delays, **kwargs):
        super().__init__(**kwargs)
        self.delays, self.sent = delays, []

    def merge_now(self):
        time.sleep(self.delays[self.ctx.rank])
        self.sent.append(flat_state(self.model))
        return super().merge_now()


def _ordered_worker(rank, world, delays):
    x, y = _data()
    strategy = DelayedAsync(delays)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      seed=5, verbose=False)
    summary = trainer.fit((x, y), epochs=1)
    return strategy.sent[0], flat_state(model), summary.strategy_results["merges"], strategy.max_staleness_seen


@pytest.mark.parametrize("delays", [(0.0, 0.6, 1.2), (1.2, 0.6, 0.0)], ids=["order-012", "order-210"])
def test_one_merge_each_in_a_forced_order_equals_the_synchronous_average(delays):
    results = run_distributed(_ordered_worker, 3, delays)
    locals_ = torch.stack([r[0] for r in results])
    final = results[0][1]
    assert torch.allclose(final, locals_.mean(dim=0), atol=1e-6)
    assert all(torch.equal(r[1], final) for r in results)
    assert results[0][2] == [1, 1, 1]
    staleness = [r[3] for r in results]
    order = sorted(range(3), key=lambda rank: delays[rank])
    assert [staleness[rank] for rank in order] == [0, 1, 2]


def _many_epochs_worker(rank, world):
    x, y = _data(n=64, seed=rank)
    strategy = Async()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "cross-entropy", strategy, batch_size=16,
                      seed=0, verbose=False)
    summary = trainer.fit((x, y), epochs=20)
    version = strategy.global_model.version if rank == 0 else None
    return summary.strategy_results["merges"], version


def test_no_merge_is_lost_when_four_workers_merge_many_tiny_epochs_at_once():
    results = run_distributed(_many_epochs_worker, 4)
    merges, version = results[0]
    assert merges == [20, 20, 20, 20]
    assert version == 80


def _staleness_worker(rank, world, max_staleness):
    x, y = _data(n=256)
    strategy = Async(max_staleness=max_staleness)
    model = _model()
    # rank 1 is a 5x straggler: rank 0 merges many epochs while rank 1 is inside one
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "cross-entropy", strategy, batch_size=8,
                      seed=0, verbose=False).emulate_straggler(5.0 if rank == 1 else 1.0)
    summary = trainer.fit((x, y), epochs=4)
    return summary.strategy_results["refreshes"], summary.strategy_results["merges"]


def test_a_worker_behind_the_staleness_bound_refreshes_before_it_continues():
    refreshes, merges = run_distributed(_staleness_worker, 2, 0)[0]
    assert refreshes[1] > 0
    assert merges == [4, 4]
    refreshes, _ = run_distributed(_staleness_worker, 2, None)[0]
    assert refreshes == [0, 0]
