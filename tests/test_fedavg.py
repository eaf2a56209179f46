"""fedavg: partitions cover every sample once, the server average is weighted by sample counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.data import load_dataset
from dptrain.data.partition import contiguous, dirichlet, iid, partition
from dptrain.errors import UserError
from dptrain.strategies.asynchronous import flat_state
from dptrain.strategies.collectives import weighted_average_module
from dptrain.strategies.fedavg import FedAvg
from dptrain.train.trainer import Trainer

DIGIT_LABELS = load_dataset("digits").y_train.to_numpy()


def _covers_once(parts, n):
    joined = np.concatenate(parts)
    return len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))


@pytest.mark.parametrize("clients", [1, 2, 3, 7])
def test_iid_and_contiguous_cover_every_sample_once(clients):
    for parts in (iid(1001, clients, seed=3), contiguous(1001, clients)):
        assert _covers_once(parts, 1001)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert np.array_equal(iid(100, 3, seed=1)[0], iid(100, 3, seed=1)[0])
    assert not np.array_equal(iid(100, 3, seed=1)[0], iid(100, 3, seed=2)[0])


def _max_class_share(parts, labels):
    shares = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    return float(np.mean(shares))


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_covers_every_sample_once(alpha):
    parts = dirichlet(DIGIT_LABELS, 4, alpha, seed=0)
    assert _covers_once(parts, len(DIGIT_LABELS))
    assert all(len(p) >= 1 for p in parts)


def test_dirichlet_skews_labels_as_alpha_says():
    skewed = _max_class_share(dirichlet(DIGIT_LABELS, 4, 0.05, seed=0), DIGIT_LABELS)
    balanced = _max_class_share(dirichlet(DIGIT_LABELS, 4, 100.0, seed=0), DIGIT_LABELS)
    uniform = np.bincount(DIGIT_LABELS).max() / len(DIGIT_LABELS)
    assert skewed > 0.35  # with 10 classes over 4 clients: a few classes dominate each client
    assert balanced < uniform + 0.05  # close to the label distribution of the whole set
    assert skewed > 3 * balanced


def test_partition_errors_are_one_sentence():
    with pytest.raises(UserError, match="integer class labels"):
        partition("dirichlet", np.linspace(0, 1, 50), 2, seed=0)
    with pytest.raises(UserError, match="cannot give each of 5 clients"):
        partition("iid", np.zeros(3, dtype=np.int64), 5, seed=0)


# -- real processes ----------------------------------------------------------------------------

def _weighted_worker(rank, world):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model(torch.randn(4, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sent = weighted_average_module(model, weight=[1.0, 3.0][rank])
    return before, {k: v.clone() for k, v in model.state_dict().items()}, sent


def test_weighted_average_is_exact_for_unequal_weights():
    (before0, after0, sent), (before1, after1, _) = run_distributed(_weighted_worker, 2)
    for key, value in before0.items():
        if value.is_floating_point():
            assert torch.allclose(after0[key], (1 * before0[key] + 3 * before1[key]) / 4, atol=1e-6), key
            assert torch.equal(after0[key], after1[key])
    floats = (3 * 2 + 2) + (2 + 2) + (2 + 2)  # linear, BN affine, BN running stats
    assert sent == 8 + floats * 4 + 8  # total weight (float64), floats, num_batches_tracked


class RecordingFedAvg(FedAvg):
    def aggregate(self, round_index):
        self.before = flat_state(self.model)
        super().aggregate(round_index)


def _fedavg_worker(rank, world, kind, fraction):
    data = load_dataset("digits")
    strategy = RecordingFedAvg(local_epochs=2, partition=kind, alpha=0.3, clients_per_round=fraction)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "cross-entropy", strategy,
                      batch_size=32, seed=4, verbose=False)
    summary = trainer.fit((data.x_train, data.y_train), epochs=2)
    return strategy.before, flat_state(model), summary.to_dict(), [r["workers"][rank]["samples"] for r in trainer.history]


def test_fedavg_round_weights_clients_by_their_sample_counts():
    results = run_distributed(_fedavg_worker, 2, "dirichlet", 1.0)
    sizes = results[0][2]["partition_sizes"]
    assert sizes[0] != sizes[1] and sum(sizes) == len(DIGIT_LABELS)
    expected = (sizes[0] * results[0][0] + sizes[1] * results[1][0]) / sum(sizes)
    assert torch.allclose(results[0][1], expected, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2]["rounds"] == 1
    # each client trained on all of its own partition in both local epochs
    assert results[0][3] == [sizes[0]] * 2 and results[1][3] == [sizes[1]] * 2


def test_clients_not_sampled_for_a_round_sit_it_out_and_get_the_global_model():
    results = run_distributed(_fedavg_worker, 4, "iid", 0.5)
    participants = results[0][2]["participation"][0]
    assert len(participants) == 2
    global_ = results[0][1]
    sizes = results[0][2]["partition_sizes"]
    expected = sum(sizes[r] * results[r][0] for r in participants) / sum(sizes[r] for r in participants)
    assert torch.allclose(global_, expected, atol=1e-5)
    for rank, result in enumerate(results):
        assert torch.equal(result[1], global_)
        trained = result[3]
        assert trained == ([sizes[rank]] * 2 if rank in participants else [0, 0])
