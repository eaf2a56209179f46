"""Same seed, config and worker count on CPU: bitwise-identical weights (async: within a tolerance)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.data import load_dataset
from dptrain.strategies import AllReduce, Async, FedAvg, Sync
from dptrain.strategies.asynchronous import flat_state
from dptrain.train.trainer import Trainer

STRATEGIES = {
    "allreduce": lambda: AllReduce(),
    "sync": lambda: Sync(every=1),
    "local-sgd": lambda: Sync(every_steps=5, optimizer_state="average", outer="nesterov"),
    "fedavg": lambda: FedAvg(partition="dirichlet", alpha=0.5, clients_per_round=1.0),
    "async": lambda: Async(),
}


def _train(rank, world, name):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, optimizer, "cross-entropy", STRATEGIES[name](), batch_size=32, seed=11,
                      verbose=False)
    summary = trainer.fit((data.x_train, data.y_train), (data.x_test, data.y_test), epochs=2)
    return flat_state(model), summary.test_accuracy


@pytest.mark.parametrize("name", ["allreduce", "sync", "local-sgd", "fedavg"])
def test_two_runs_give_bitwise_identical_weights(name):
    (first, _), _ = run_distributed(_train, 2, name)
    (second, _), _ = run_distributed(_train, 2, name)
    assert torch.equal(first, second)


def test_async_depends_on_merge_order_but_stays_within_a_tolerance():
    # Two workers merge at their own epoch ends; which merge arrives first varies between runs,
    # and a later merge starts from a global model that does or does not hold the other's
    # last delta. Measured on a busy 2-core machine: weights differ by up to 10 % in relative
    # L2 distance (0 when the order happens to repeat); the models do the same job.
    (first, accuracy_first), _ = run_distributed(_train, 2, "async")
    (second, accuracy_second), _ = run_distributed(_train, 2, "async")
    assert (first - second).norm() / first.norm() < 0.25
    assert abs(accuracy_first - accuracy_second) <= 0.03
