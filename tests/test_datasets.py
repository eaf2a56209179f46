"""A user's own torch Dataset trains like arrays do: the same rows in the same order on every rank,
so the same final weights, under every strategy; batches are streamed, never a whole shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.data import load_dataset
from dptrain.data.sampler import EpochPlan, PlanBatches, as_dataset, labels_of, loader
from dptrain.strategies import AllReduce, Async, FedAvg, Sync
from dptrain.strategies.asynchronous import flat_state
from dptrain.train.trainer import Trainer

STRATEGIES = {"allreduce": AllReduce, "sync": Sync, "fedavg": lambda: FedAvg(partition="dirichlet"),
              "async": Async}


class DigitsItems(torch.utils.data.Dataset):
    """What a user writes: one (x, y) item at a time, numpy float64 features and int labels."""

    def __init__(self, x: np.ndarray, y: np.ndarray, with_targets: bool) -> None:
        self.x, self.y = x.astype(np.float64), y
        if with_targets:
            self.targets = list(y)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], int(self.y[index])


def _worker(rank, world, name, as_items):
    data = load_dataset("digits")
    x, y = data.x_train.to_numpy(), data.y_train.to_numpy()
    train = DigitsItems(x, y, with_targets=rank == 0) if as_items else (x, y)
    test = DigitsItems(data.x_test.to_numpy(), data.y_test.to_numpy(), True) if as_items \
        else (data.x_test, data.y_test)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "cross-entropy",
                      STRATEGIES[name](), batch_size=32, seed=3, verbose=False)
    summary = trainer.fit(train, test, epochs=2)
    return flat_state(model), summary.test_accuracy


@pytest.mark.parametrize("name", ["allreduce", "sync", "fedavg", "async"])
def test_a_user_dataset_gives_the_weights_of_the_same_data_as_arrays(name):
    arrays = run_distributed(_worker, 2, name, False)
    items = run_distributed(_worker, 2, name, True)
    assert items[0][1] >= (0.5 if name == "fedavg" else 0.80)  # label-skewed clients learn slower
    if name == "async":  # merge order varies from run to run
        assert abs(items[0][1] - arrays[0][1]) <= 0.05
    else:
        assert torch.equal(items[0][0], arrays[0][0]) and torch.equal(items[1][0], arrays[1][0])
        assert items[0][1] == arrays[0][1]


def test_plan_batches_stream_each_epoch_rows_in_order_and_read_only_those_rows():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    pairs = as_dataset((x, np.arange(20)))
    plan = EpochPlan(3, lambda epoch: np.arange(20)[::-1][epoch:epoch + 10])
    batches = PlanBatches(plan)
    batches.set_epoch(1)
    read = pairs.x.rows_read
    got = [y.tolist() for _, y in loader(pairs, batches)]
    assert got == [[18, 17, 16, 15], [14, 13, 12], [11, 10, 9]]
    assert pairs.x.rows_read - read == 10


def test_labels_come_from_the_data_the_targets_attribute_or_one_pass():
    x, y = np.zeros((6, 2)), np.array([0, 1, 2, 0, 1, 2])
    assert labels_of(as_dataset((x, y))).tolist() == y.tolist()
    assert labels_of(DigitsItems(x, y, with_targets=True)).tolist() == y.tolist()
    said = []
    assert labels_of(DigitsItems(x, y, with_targets=False), said.append).tolist() == y.tolist()
    assert said and "reading the labels of all 6 samples once" in said[0]
