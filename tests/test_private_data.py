"""Each client's own data (dptrain.data.private): a factory taking rank, four clients in four directories under
fedavg, the average weighted exactly by the sizes the clients report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_dptrain
from private_clients import SIZES, write_clients

from dptrain.data import sharding
from dptrain.data.sampler import partition_plan
from dptrain.models import build_model
from dptrain.train.step import make_loss

HERE = Path(__file__).parent
SEED, BATCH, LR = 3, 16, 0.05
ARGS = ["train", "--data", f"{HERE / 'private_clients.py'}:own_data", "--workers", 4, "--model", "mlp",
        "--batch-size", BATCH, "--lr", LR, "--momentum", 0, "--lr-scaling", "none", "--seed", SEED,
        "--no-progress", "--device", "cpu"]


def _local_model(initial: torch.nn.Module, client: int, root: Path) -> torch.nn.Module:
    """Client `client`'s model after one local epoch, trained here as its rank trains it."""
    model = build_model("mlp", (6,), 3)
    model.load_state_dict(initial.state_dict())
    arrays = np.load(root / "clients" / f"client{client}" / "data.npz")
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    plan = partition_plan(np.arange(len(y)), client, BATCH, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    loss_fn = make_loss("cross-entropy")
    for rows in sharding.batches(plan.rows(0), plan.steps):
        loss_fn(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.slow
def test_four_clients_with_their_own_directories_average_weighted_by_their_reported_sizes(tmp_path):
    write_clients(tmp_path)
    result = run_dptrain([*ARGS, "--strategy", "fedavg", "--epochs", 1, "--out", "run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert ("takes rank: each of the 4 clients loads its own data on its own rank; checked here: client 0's only"
            in result.stdout)
    opened = sorted((tmp_path / "clients" / "opened.txt").read_text().splitlines())
    assert opened == ["0 0 4", "1 1 4", "2 2 4", "3 3 4", "launcher 0 4"]  # each rank opened its own files only
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["partition_sizes"] == list(SIZES) and summary["rounds"] == 1
    torch.manual_seed(SEED)
    initial = build_model("mlp", (6,), 3)
    local = [_local_model(initial, client, tmp_path) for client in range(4)]
    final = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    total = sum(SIZES)
    for name, value in final.items():
        weighted = sum(size * dict(model.state_dict())[name] for size, model in zip(SIZES, local)) / total
        plain = sum(dict(model.state_dict())[name] for model in local) / 4
        assert torch.allclose(value, weighted, atol=1e-6, rtol=0), name
        assert not torch.allclose(value, plain, atol=1e-4, rtol=0) or name.endswith("num_batches_tracked")


def test_private_data_under_a_strategy_that_shares_one_data_set_is_refused(tmp_path):
    write_clients(tmp_path)
    result = run_dptrain([*ARGS, "--workers", 2, "--strategy", "allreduce", "--epochs", 1], cwd=tmp_path,
                         env={**os.environ})
    assert result.returncode == 2, result.stderr
    assert ("--strategy allreduce shares one data set out over the workers; each client's own data (a --data "
            "factory taking rank) trains under --strategy fedavg") in result.stderr


def test_a_factory_of_private_iterable_data_is_refused_in_one_line(tmp_path):
    from dptrain.data.user import load_user_data
    from dptrain.errors import UserError

    (tmp_path / "own_stream.py").write_text(
        "import torch\n\n"
        "class Stream(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        return iter([(torch.zeros(2), 0), (torch.ones(2), 1)])\n\n"
        "def own(rank, world):\n"
        "    return Stream()\n")
    with pytest.raises(UserError, match="a factory of each client's own data returns map-style Datasets"):
        load_user_data(f"{tmp_path / 'own_stream.py'}:own", seed=0, log=lambda line: None, workers=2)


@pytest.mark.parametrize("flag", [["--partition", "dirichlet"], ["--alpha", "0.1"]], ids=["partition", "alpha"])
def test_a_partition_given_with_each_clients_own_data_is_refused_in_one_line(tmp_path, flag):
    # --partition and --alpha split one shared data set; each client's own data is split already (not ignored)
    write_clients(tmp_path)
    before = sorted(tmp_path.iterdir())
    result = run_dptrain([*ARGS, "--workers", 2, "--strategy", "fedavg", "--epochs", 1, *flag], cwd=tmp_path,
                         env={**os.environ})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"dptrain: error: --{flag[0][2:]} {flag[1]} splits one dataset every rank reads into the clients' parts, and "
        f"--data {HERE / 'private_clients.py'}:own_data gives each client its own data (its factory takes rank): "
        f"drop --{flag[0][2:]}"]
    assert sorted(tmp_path.iterdir()) == before  # no run directory made
