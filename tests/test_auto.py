"""--strategy auto: the decision's arithmetic by hand, and real runs whose weights equal the chosen strategy's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dptrain import costmodel
from dptrain.config import build_config
from dptrain.errors import UserError
from dptrain.lr_policy import ConfigSchedule
from dptrain.strategies.auto import (ALL_CANDIDATES, SAFE_CANDIDATES, Auto, Candidate, bandwidth_from, decision_line,
                                     latency_from, pick, predict)
from dptrain.strategies.sync import Sync
from cli_runner import run_dptrain

CAL = costmodel.Calibration(seconds_per_sample=1e-3, model_bytes=1_000_000, bandwidth=1e6, latency=1e-3,
                            samples=1000, batch_size=10)
FLAGS = ["--dataset", "digits", "--model", "mlp", "--epochs", "2", "--batch-size", "32", "--seed", "3",
         "--no-progress"]


def test_latency_and_bandwidth_invert_the_ring_formula():
    assert latency_from(0.004, 2) == pytest.approx(0.002)
    assert latency_from(0.012, 4) == pytest.approx(0.002)
    for workers in (2, 4):
        seconds = costmodel.ring_allreduce_seconds(workers, 4e6, 1e8, 1e-3)  # 0.042 s for 2, 0.066 s for 4
        assert bandwidth_from(seconds, 4_000_000, workers, 1e-3) == pytest.approx(1e8)
    assert bandwidth_from(0.042, 4_000_000, 2, 1e-3) == pytest.approx(4e6 / 0.04)


def test_predictions_are_the_cost_models_epochs_and_the_smallest_wins():
    safe = predict(SAFE_CANDIDATES, 2, CAL)
    assert safe == pytest.approx({"allreduce": 0.5 + 50 * 1.002, "sync every 1": 0.5 + 1.002})
    assert pick(SAFE_CANDIDATES, safe) == Candidate("sync", 1)
    every = predict(ALL_CANDIDATES, 2, CAL)
    assert every["sync every 3"] == pytest.approx(0.5 + 1.002 / 3)
    assert every["async"] == pytest.approx(0.5 + 2 * 1.001)  # own round trip: 2 x (alpha + M/B)
    assert pick(ALL_CANDIDATES, every) == Candidate("sync", 3)
    # compression halves the sync payload (the two-step mean of fp16: 0.5 s + 2 alpha) and allreduce's ring
    fp16 = predict(SAFE_CANDIDATES, 2, CAL, "fp16")
    assert fp16 == pytest.approx({"allreduce": 0.5 + 50 * 0.502, "sync every 1": 0.5 + 0.502})
    # a link that costs nothing: a tie, and the first listed (allreduce) is kept
    free = costmodel.Calibration(**{**CAL.as_dict(), "latency": 0.0, "model_bytes": 0})
    tie = predict(SAFE_CANDIDATES, 2, free)
    assert tie == {"allreduce": 0.5, "sync every 1": 0.5}
    assert pick(SAFE_CANDIDATES, tie) == Candidate("allreduce")
    # compute-bound on a fast link: allreduce's 50 rings of 1 ms cost 0.05 s over 0.5 s of compute: 10 % more
    # than sync (0.501 s): sync; with 0.5 ms rings (5 % more, within the tolerance) the exact allreduce is kept
    fast = costmodel.Calibration(**{**CAL.as_dict(), "bandwidth": 1e9, "latency": 0.0})  # a ring takes 1 ms
    assert predict(SAFE_CANDIDATES, 2, fast) == pytest.approx({"allreduce": 0.55, "sync every 1": 0.501})
    assert pick(SAFE_CANDIDATES, predict(SAFE_CANDIDATES, 2, fast)) == Candidate("sync", 1)
    assert pick(SAFE_CANDIDATES, {"allreduce": 0.525, "sync every 1": 0.5001}) == Candidate("allreduce")
    assert pick(SAFE_CANDIDATES, {"allreduce": 0.526, "sync every 1": 0.5}) == Candidate("sync", 1)
    assert pick(ALL_CANDIDATES, {"allreduce": 1.0, "sync every 1": 0.7, "sync every 2": 0.68, "sync every 3": 0.6,
                                 "async": 0.65}) == Candidate("sync", 3)
    assert pick(ALL_CANDIDATES, {"allreduce": 1.0, "sync every 1": 0.7, "sync every 2": 0.68, "sync every 3": 0.69,
                                 "async": 0.67}) == Candidate("sync", 1)  # 0.7 <= 1.05 x 0.67


def test_decision_line_names_the_choice_and_every_prediction():
    choice = {"workers": 2, "candidates": "safe", "chosen": "sync every 1",
              "predicted_epoch_seconds": {"allreduce": 0.8561, "sync every 1": 0.2804},
              "measured": {"bandwidth_bytes_per_second": 12.3e6, "latency_seconds": 3e-5, "seconds_per_sample": 3.58e-4}}
    assert decision_line(choice) == (
        "dptrain: --strategy auto chose sync every 1: predicted seconds per epoch allreduce 0.856 s, "
        "sync every 1 0.28 s (safe candidates; measured link 98.4 Mbit/s, latency 30 us, compute 358 us per sample "
        "on the slowest of 2 ranks)")
    assert decision_line({"workers": 1}) == ("dptrain: --strategy auto with 1 worker: nothing to communicate, "
                                             "training as allreduce (no measurement)")


def test_auto_is_a_config_choice_and_builds_the_chosen_strategy_as_its_flags_would():
    config = build_config({"strategy": "auto", "auto_candidates": "all", "optimizer_state": "reset"})
    auto = Auto.from_config(config)
    assert auto.candidates == ALL_CANDIDATES
    sync = auto.build(Candidate("sync", 3))
    assert isinstance(sync, Sync) and sync.every == 3 and sync.optimizer_state == "reset"
    with pytest.raises(UserError, match=r"key 'auto_candidates' in the settings \(--auto-candidates\) must be one of "
                                        r"safe, all \(got 'most'\)"):
        build_config({"strategy": "auto", "auto_candidates": "most"})
    with pytest.raises(UserError, match=r"compression int8 does not apply to strategy auto: it may pick allreduce"):
        build_config({"strategy": "auto", "compression": "int8"})
    fp16 = Auto.from_config(build_config({"strategy": "auto", "compression": "fp16"}))
    assert fp16.build(Candidate("sync", 1)).describe()["compression"] == "fp16"
    assert fp16.build(Candidate("allreduce")).compression == "fp16"


def dptrain(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_dptrain(args, cwd=cwd, env={**os.environ, **(env or {})})


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_bad_candidates_flag_is_one_line_and_exit_2(tmp_path):
    result = dptrain("train", "--strategy", "auto", "--auto-candidates", "most", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "dptrain: error: --auto-candidates must be one of safe, all (got 'most')"


@pytest.mark.slow
def test_two_workers_choose_by_measurement_and_train_exactly_as_the_chosen_strategy(tmp_path):
    auto = dptrain("train", *FLAGS, "--strategy", "auto", "--workers", "2", "--out", str(tmp_path / "auto"),
                   cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    choice = summary["strategy_options"]["auto"]
    predictions = choice["predicted_epoch_seconds"]
    assert set(predictions) == {"allreduce", "sync every 1"}
    fastest = min(predictions.values())
    expected = "allreduce" if predictions["allreduce"] <= 1.05 * fastest else "sync every 1"
    assert choice["chosen"] == expected and choice["tolerance"] == 0.05
    assert summary["strategy"] == choice["strategy"] and summary["strategy_options"]["name"] == choice["strategy"]
    assert choice["measured"]["bandwidth_bytes_per_second"] > 0 and choice["measured"]["latency_seconds"] > 0
    assert len(choice["measured"]["seconds_per_sample_per_rank"]) == 2
    assert json.loads((tmp_path / "auto" / "strategy_choice.json").read_text()) == choice
    lines = [line for line in auto.stdout.splitlines() if "--strategy auto" in line]
    assert len(lines) == 1 and f"chose {choice['chosen']}:" in lines[0], auto.stdout

    direct = dptrain("train", *FLAGS, "--strategy", choice["strategy"], "--sync-every", str(choice["every"]),
                     "--workers", "2", "--out", str(tmp_path / "direct"), cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr
    first, second = weights(tmp_path / "auto"), weights(tmp_path / "direct")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    same = json.loads((tmp_path / "direct" / "summary.json").read_text())
    assert same["test_accuracy"] == summary["test_accuracy"] and same["comm_bytes"] == summary["comm_bytes"]
    assert {k: v for k, v in summary["strategy_options"].items() if k != "auto"} == same["strategy_options"]


def test_one_worker_trains_as_allreduce_without_measuring_and_says_so(tmp_path, capsys):
    from dptrain.train.command import train_from_config

    settings = {"dataset": "digits", "model": "mlp", "epochs": 1, "batch_size": 32, "seed": 3, "workers": 1,
                "progress": False}
    summary = train_from_config({**settings, "strategy": "auto", "out": str(tmp_path / "auto")})
    said = capsys.readouterr().out
    assert said.count("--strategy auto") == 1
    assert ("dptrain: --strategy auto with 1 worker: nothing to communicate, training as allreduce (no measurement)"
            in said)
    assert summary.strategy == "allreduce"
    assert summary.strategy_options["auto"] == {"workers": 1, "candidates": "safe", "chosen": "allreduce",
                                                "reason": "one worker: nothing to communicate"}
    assert json.loads((tmp_path / "auto" / "strategy_choice.json").read_text()) == summary.strategy_options["auto"]
    train_from_config({**settings, "strategy": "allreduce", "out": str(tmp_path / "direct")})
    first, second = weights(tmp_path / "auto"), weights(tmp_path / "direct")
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.slow
def test_a_restarted_run_keeps_the_choice_it_began_with(tmp_path):
    """Rank 1 dies after its epoch-2 checkpoint; the restarted workers read strategy_choice.json, not a new measurement."""
    result = dptrain("train", "--dataset", "digits", "--model", "mlp", "--epochs", "3", "--no-progress",
                     "--strategy", "auto", "--workers", "2",
                     "--checkpoint-every", "1", "--max-restarts", "1", "--out", str(tmp_path / "run"), cwd=tmp_path,
                     env={"DPTRAIN_FAULT": "save-end@1:2", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fired").exists() and "restarting the 2 workers" in result.stderr
    lines = [line for line in result.stdout.splitlines() if "--strategy auto chose" in line]
    assert len(lines) == 2 and lines[1].endswith("(as decided when the run began)"), result.stdout
    assert lines[1].removesuffix(" (as decided when the run began)") == lines[0]
    recorded = json.loads((tmp_path / "run" / "strategy_choice.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy_options"]["auto"] == recorded and summary["strategy"] == recorded["strategy"]


@pytest.mark.parametrize("settings, chosen, lr", [
    ({"lr_scaling": "auto"}, Candidate("sync", 1), 0.1),  # auto: sync scales the LR, as --strategy sync would
    ({"lr_scaling": "auto", "optimizer": "adam"}, Candidate("async", 1), 0.1),
    ({"lr_scaling": "auto"}, Candidate("allreduce"), 0.05),
    ({}, Candidate("sync", 1), 0.05),  # the default keeps --lr
    ({"lr_scaling": "sqrt"}, Candidate("allreduce"), 0.05 * 2 ** 0.5),  # applied before the choice, kept
    ({}, Candidate("allreduce"), 0.05),  # allreduce keeps it
    ({"lr_scaling": "linear"}, Candidate("allreduce"), 0.1),  # an explicit rule was applied before: not twice
    ({"lr_scaling": "none"}, Candidate("sync", 1), 0.05),
])
def test_the_chosen_strategy_gets_the_lr_its_own_flag_would_give(settings, chosen, lr):
    from types import SimpleNamespace

    config = build_config({"strategy": "auto", "lr": 0.05, **settings})
    applied = 0.05 * config.lr_scale(2)[0]  # what the launcher gave the optimizer before the choice
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=applied)
    said = []
    trainer = SimpleNamespace(ctx=SimpleNamespace(world_size=2), optimizer=optimizer,
                              recorder=SimpleNamespace(log=said.append),
                              schedule=ConfigSchedule(config, 2))  # as train_in_group builds it
    Auto.from_config(config)._scale_lr_for(chosen, trainer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    assert len(said) == (1 if lr != applied else 0)
    # the schedule (its warm-up) follows the chosen strategy's settings
    assert trainer.schedule.config.strategy == (chosen.strategy if lr != applied else "auto")
    assert trainer.schedule.world == 2
    assert trainer.lr_scale == (2.0 if settings.get("lr_scaling") == "auto" and chosen.strategy != "allreduce" else 1.0)


def test_measure_compute_times_the_callers_step_and_puts_everything_back():
    """auto times the step its caller gives (the Trainer's timing_step), with a fresh optimizer of the run's
    kind, and leaves the model, the run's optimizer and the RNG as they were."""
    from types import SimpleNamespace

    from dptrain.data.sampler import as_dataset
    from dptrain.strategies.auto import measure_compute

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    train = as_dataset((torch.randn(10, 3), torch.randint(0, 2, (10,))))
    calls = []

    def step(stepped, timed, x, y):
        assert stepped is model and timed is not optimizer
        assert type(timed) is torch.optim.SGD and timed.defaults == optimizer.defaults
        torch.nn.functional.cross_entropy(stepped(x), y).backward()
        timed.step()
        calls.append(len(y))

    rng = torch.get_rng_state()
    seconds = measure_compute(step, model, optimizer, SimpleNamespace(rank=0, device=torch.device("cpu")), 4, train,
                              steps=2)
    assert calls == [4, 4, 4]  # one warm-up and `steps` timed steps of whole batches
    assert seconds > 0
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())
    assert optimizer.state_dict()["state"] == {} and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_schedule_of_the_users_own_is_kept_when_auto_rescales():
    from dptrain import lr_policy

    config = build_config({"strategy": "auto", "lr": 0.05, "lr_scaling": "auto"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    own = lambda optimizer, steps, epochs: None  # noqa: E731 - a schedule the trainer was given by its user
    rescaled = lr_policy.rescale_for(config, "sync", 4, optimizer, own)
    assert (rescaled.schedule, rescaled.lr_scale, optimizer.param_groups[0]["lr"]) == (own, 4.0, pytest.approx(0.2))
    assert rescaled.line == lr_policy.lr_line(config.model_copy(update={"strategy": "sync"}), 4)
    assert "learning rate 0.2 (0.05 x 4, --lr-scaling auto" in rescaled.line
