"""The Flower FedAvg baseline (benchmarks/baselines/flower_fedavg.py) and its comparison script.

The summary statistics are checked by hand without flwr; the Flower parts skip when flwr is not
installed (it is an optional benchmark extra: `pip install -e .[flower]`).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_FLWR = importlib.util.find_spec("flwr") is not None
needs_flwr = pytest.mark.skipif(not HAS_FLWR, reason="flwr is not installed (optional: pip install -e .[flower])")


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare():
    return load("federated_flower", ROOT / "benchmarks" / "federated_flower.py")


@pytest.fixture(scope="module")
def baseline():
    return load("flower_fedavg", ROOT / "benchmarks" / "baselines" / "flower_fedavg.py")


def test_mean_and_std_over_seeds_per_round(compare):
    mean, std = compare.mean_std([[0.5, 0.7], [0.7, 0.9]])
    assert mean == pytest.approx([0.6, 0.8])
    assert std == pytest.approx([math.sqrt(0.02), math.sqrt(0.02)])  # sample std: ((0.1² + 0.1²) / 1) ** 0.5
    assert compare.mean_std([[0.25, 0.5]]) == ([0.25, 0.5], [0.0, 0.0])


def test_paired_difference_and_its_noise_band(compare):
    # differences 0.1, 0, 0.1: mean 1/15, sample sd sqrt(3)/30, band 1.96 * sd / sqrt(3) = 1.96/30
    result = compare.paired([0.9, 0.8, 0.7], [0.8, 0.8, 0.6])
    assert result["mean"] == pytest.approx(1 / 15)
    assert result["sd"] == pytest.approx(math.sqrt(3) / 30)
    assert result["band95"] == pytest.approx(1.96 / 30)
    assert result["beyond_noise"] is True  # 0.0667 > 0.0653
    assert compare.paired([0.9, 0.8, 0.7], [0.8, 0.8, 0.65])["beyond_noise"] is False  # mean 0.05 < band 0.0882


def test_unknown_variant_is_refused_with_exit_code_2(compare, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare.arguments(["--out", "x", "--variants", "dptrain,flwoer"])
    assert exit_info.value.code == 2
    assert "--variants flwoer unknown; valid: dptrain,flower,dptrain-m0,flower-m0,flower-carry,dptrain-reset" in capsys.readouterr().err


def test_dptrain_and_flower_commands_name_the_same_settings(compare):
    args = compare.arguments(["--out", "x", "--rounds", "7", "--lr", "0.03", "--batch-size", "16"])
    for name in ("dptrain", "flower-m0"):
        cmd = compare.command(compare.VARIANTS[name], 0.1, 4, args, Path("run"))
        settings = dict(zip(cmd, cmd[1:]))
        assert (settings["--alpha"], settings["--seed"], settings["--lr"], settings["--batch-size"]) == \
            ("0.1", "4", "0.03", "16")
        assert settings["--partition"] == "dirichlet" and settings["--dataset"] == "digits"
        assert settings["--model"] == "mlp"
    dptrain = compare.command(compare.VARIANTS["dptrain"], 0.1, 4, args, Path("run"))
    assert dptrain[1:4] == ["-m", "dptrain", "train"]
    flags = dict(zip(dptrain, dptrain[1:]))
    assert [flags[f] for f in ("--strategy", "--workers", "--local-epochs", "--epochs", "--momentum")] == \
        ["fedavg", "4", "1", "7", "0.9"]
    flower = compare.command(compare.VARIANTS["flower-m0"], 0.1, 4, args, Path("run"))
    assert dict(zip(flower, flower[1:]))["--momentum"] == "0.0"
    assert dict(zip(flower, flower[1:]))["--rounds"] == "7"


def test_a_dptrain_that_ignores_optimizer_state_is_refused(compare, tmp_path):
    # A recorded run (reused, nothing is trained) whose fedavg did not take --optimizer-state.
    run = tmp_path / "dptrain-reset-alpha0.1-seed0"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 1, "test_accuracy": 0.5}\n')
    (run / "process_seconds.txt").write_text("1.0\n")
    (run / "summary.json").write_text(json.dumps({"wall_seconds": 1.0, "strategy_options": {"name": "fedavg"}}))
    args = compare.arguments(["--out", "x", "--rounds", "1", "--variants", "dptrain-reset"])
    cmd = compare.command(compare.VARIANTS["dptrain-reset"], 0.1, 0, args, run)
    assert cmd[cmd.index("--optimizer-state") + 1] == "reset"
    with pytest.raises(SystemExit, match="does not record --optimizer-state"):
        compare.run(cmd, run, reuse=True)
    (run / "summary.json").write_text(json.dumps({"wall_seconds": 1.0, "strategy_options": {
        "name": "fedavg", "optimizer_state": "reset"}}))
    assert compare.run(cmd, run, reuse=True)["accuracy"] == [0.5]


def test_clients_hold_dptrain_s_dirichlet_partition(baseline):
    from dptrain.data.partition import dirichlet
    args = baseline.arguments(["--alpha", "0.3", "--seed", "5", "--clients", "3", "--out", "x"])
    federation = baseline.Federation(args)
    expected = dirichlet(federation.y_train.numpy(), 3, 0.3, 5)
    assert all(np.array_equal(a, b) for a, b in zip(federation.parts, expected))
    assert sorted(np.concatenate(federation.parts).tolist()) == list(range(len(federation.y_train)))


@needs_flwr
def test_a_flower_round_is_the_sample_weighted_mean_of_the_clients(baseline):
    args = baseline.arguments(["--alpha", "0.5", "--seed", "1", "--clients", "3", "--rounds", "1", "--momentum", "0",
                               "--mode", "inprocess", "--out", "x"])
    federation = baseline.Federation(args)
    initial = baseline.build_like(federation.model)
    sizes = [len(p) for p in federation.parts]
    assert len(set(sizes)) == 3  # unequal clients: a plain mean would differ from the weighted one
    trained = []
    for cid in range(3):
        model = baseline.build_like(initial)
        federation.train_round(cid, model, torch.optim.SGD(model.parameters(), lr=args.lr), 1)
        trained.append([w.astype(np.float64) for w in federation.weights(model)])
    expected = [sum(n * w[i] for n, w in zip(sizes, trained)) / sum(sizes) for i in range(len(trained[0]))]
    history, _ = baseline.run_inprocess(federation)
    got = federation.weights()
    assert max(np.abs(g - e).max() for g, e in zip(got, expected)) < 1e-6
    plain = [sum(w[i] for w in trained) / 3 for i in range(len(trained[0]))]
    assert max(np.abs(g - p).max() for g, p in zip(got, plain)) > 1e-4
    assert [r["epoch"] for r in history] == [0, 1]
    check = baseline.build_like(initial)
    federation.load(check, expected)
    with torch.no_grad():
        correct = (check(federation.x_test).argmax(1) == federation.y_test).sum().item()
    assert history[1]["test_accuracy"] == correct / len(federation.y_test)


@needs_flwr
@pytest.mark.slow
def test_flower_with_carried_momentum_reproduces_dptrain_fedavg(baseline, tmp_path):
    """dptrain's CLI (2 processes) and Flower's FedAvg driven in-process, 2 rounds: the same global models
    when Flower's clients keep their optimizer; not when they start each round afresh (Flower's default)."""
    settings = ["--alpha", "0.5", "--seed", "3", "--lr", "0.05", "--momentum", "0.9", "--batch-size", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "dptrain", "train", "--strategy", "fedavg", "--partition", "dirichlet",
                    "--workers", "2", "--epochs", "2", "--checkpoint-every", "0", "--no-progress", *settings,
                    "--out", str(tmp_path / "dptrain")], env=env, check=True, timeout=240, capture_output=True)
    common = ["--clients", "2", "--rounds", "2", "--mode", "inprocess", *settings]
    baseline.main([*common, "--carry-momentum", "--out", str(tmp_path / "carry")])
    baseline.main([*common, "--out", str(tmp_path / "fresh")])
    reference = torch.load(tmp_path / "dptrain" / "model.pt")

    def gap(run):
        weights = torch.load(tmp_path / run / "model.pt")
        return max((weights[k] - reference[k]).abs().max().item() for k in reference)

    def accuracy(run):
        return [json.loads(line)["test_accuracy"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert gap("carry") < 1e-5
    assert accuracy("carry") == accuracy("dptrain")
    assert gap("fresh") > 1e-3  # round 2 starts momentum from zero
