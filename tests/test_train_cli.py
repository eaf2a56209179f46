"""`dptrain train` end to end: real worker processes on 127.0.0.1, real run directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dptrain.data import load_dataset
from dptrain.models import build_model
from dptrain.runtime.env import free_port
from cli_runner import run_dptrain

pytestmark = pytest.mark.slow
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "10", "--batch-size", "32", "--lr", "0.05"]


def dptrain(*args: str, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_dptrain(args, cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def same_model(first_run: Path, second_run: Path) -> bool:
    """Whether two run directories' model.pt hold bitwise equal weights."""
    first = torch.load(first_run / "model.pt", weights_only=True)
    second = torch.load(second_run / "model.pt", weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """One allreduce and one sync run with 2 workers, shared by the tests that read them."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for strategy in ("allreduce", "sync"):
        result = dptrain("train", *DIGITS, "--strategy", strategy, "--workers", "2", "--out", str(root / strategy),
                         cwd=root)
        assert result.returncode == 0, result.stderr
        runs[strategy] = (root / strategy, result)
    return runs


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_the_last_line_is_the_summary_json_and_the_epoch_lines_its_metrics(digits_runs, strategy):
    from dptrain.train.recorder import Summary, summary_line
    run_dir, result = digits_runs[strategy]
    summary = json.loads((run_dir / "summary.json").read_text())
    last = result.stdout.splitlines()[-1]
    assert last == summary_line(Summary.from_dict(summary), run_dir)
    assert f"test_acc {summary['test_accuracy']:.4f}" in last and f"{summary['comm_bytes']:,} bytes" in last
    assert last.endswith(f"model in {run_dir / 'model.pt'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank0] epoch ")]
    for record, line in zip(records, lines, strict=True):
        assert f"test_acc {record['test_accuracy']:.4f}" in line
        assert f"comm {record['comm_bytes'] / 1e6:,.3f} MB so far" in line and "alone" not in line


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_two_workers_reach_90_percent_on_digits(digits_runs, strategy):
    run_dir, result = digits_runs[strategy]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["workers"] == 2 and summary["launcher"] == "local"
    assert summary["test_accuracy"] >= 0.90
    assert summary["model_parameters"] == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert summary["comm_bytes"] == sum(summary["comm_bytes_per_worker"])
    assert "[rank0] epoch 10/10" in result.stdout
    # One line says what the wait is for while the workers start, before anything they print.
    starting = f"dptrain: run directory {run_dir}; starting 2 workers on this machine...\n"
    assert result.stdout.startswith(starting), result.stdout[:500]


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_metrics_have_one_record_per_epoch_with_the_promised_fields(digits_runs, strategy):
    run_dir, _ = digits_runs[strategy]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, 11))
    for record in records:
        for key in ("train_loss", "test_loss", "test_accuracy", "samples_per_second", "comm_bytes", "wall_seconds"):
            assert record[key] is not None, key
        # every sample of the 1437-sample training split is seen exactly once per epoch
        assert sum(worker["samples"] for worker in record["workers"]) == 1437
    walls = [r["wall_seconds"] for r in records]
    assert walls == sorted(walls)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert records[-1]["comm_bytes"] == summary["comm_bytes"]


def test_comm_bytes_are_exact_and_sync_sends_over_10x_less(digits_runs):
    parameter_bytes = 17226 * 4
    steps = 10 * 23  # ceil(719 / 32) steps per epoch on each worker
    allreduce = json.loads((digits_runs["allreduce"][0] / "summary.json").read_text())
    sync = json.loads((digits_runs["sync"][0] / "summary.json").read_text())
    assert allreduce["comm_bytes_per_worker"] == [parameter_bytes * (1 + steps)] * 2
    assert sync["comm_bytes_per_worker"] == [parameter_bytes * (1 + 10)] * 2
    assert allreduce["comm_bytes"] >= 10 * sync["comm_bytes"]


def test_sync_keeps_the_lr_by_default_and_auto_says_what_it_scaled_to(digits_runs, tmp_path):
    for strategy in ("allreduce", "sync"):
        assert "learning rate" not in digits_runs[strategy][1].stdout  # --lr-scaling none, the default
    records = [json.loads(line) for line in (digits_runs["sync"][0] / "metrics.jsonl").read_text().splitlines()]
    assert {record["lr"] for record in records} == {0.05}
    auto = dptrain("train", *DIGITS, "--strategy", "sync", "--workers", "2", "--epochs", "2", "--lr-scaling", "auto",
                   "--out", str(tmp_path / "auto"), cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr
    assert ("[rank0] dptrain: sync on 2 workers trains with learning rate 0.1 (0.05 x 2, --lr-scaling auto, "
            "warmed up over 0.2 epochs, backed off if an average goes wrong); --lr-scaling none keeps 0.05") in auto.stdout


def test_an_explicit_linear_rule_equals_the_scaled_lr_given_by_hand(tmp_path):
    scaled = dptrain("train", *DIGITS, "--epochs", "2", "--strategy", "sync", "--workers", "2", "--lr-scaling",
                     "linear", "--warmup-epochs", "1", "--out", str(tmp_path / "scaled"), cwd=tmp_path)
    assert scaled.returncode == 0, scaled.stderr
    assert ("[rank0] dptrain: sync on 2 workers trains with learning rate 0.1 (0.05 x 2, --lr-scaling linear); "
            "--lr-scaling none keeps 0.05") in scaled.stdout
    by_hand = dptrain("train", *DIGITS[:-1], "0.1", "--epochs", "2", "--warmup-epochs", "1", "--strategy",
                      "sync", "--workers", "2", "--out", str(tmp_path / "by-hand"), cwd=tmp_path)
    assert by_hand.returncode == 0, by_hand.stderr
    assert "learning rate" not in by_hand.stdout
    ours, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (tmp_path / "scaled", tmp_path / "by-hand"))
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_saved_model_is_the_global_model_and_loads_weights_only(digits_runs):
    run_dir, _ = digits_runs["sync"]
    state = torch.load(run_dir / "model.pt", weights_only=True)
    data = load_dataset("digits")
    model = build_model("mlp", data.input_shape, data.num_outputs)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(data.x_test.to_numpy())).argmax(dim=1).numpy()
    accuracy = float(np.mean(predictions == data.y_test.to_numpy()))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-9)


def test_config_yaml_reproduces_the_run_bitwise(digits_runs, tmp_path):
    run_dir, _ = digits_runs["sync"]
    result = dptrain("train", "--config", str(run_dir / "config.yaml"), "--out", str(tmp_path / "again"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert same_model(run_dir, tmp_path / "again")


def test_config_yaml_records_absolute_paths_and_repeats_the_run_from_another_directory(tmp_path):
    # Data and the model's file given relative to the project: config.yaml names them absolutely.
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    rng = np.random.default_rng(0)
    np.savez(project / "tiny.npz", x=rng.standard_normal((64, 4)).astype(np.float32), y=np.arange(64) % 2)
    (project / "nets.py").write_text("from torch import nn\n\n\ndef make(input_shape, num_outputs):\n"
                                     "    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.ReLU(), "
                                     "nn.Linear(8, num_outputs))\n")
    first = dptrain("train", "--data", "tiny.npz", "--model", "./nets.py:make", "--workers", "1", "--epochs", "2",
                    "--batch-size", "8", "--out", "run", cwd=project)
    assert first.returncode == 0, first.stderr
    config = yaml.safe_load((project / "run" / "config.yaml").read_text())
    assert config["data"] == str(project / "tiny.npz") and config["model"] == f"{project}/nets.py:make", config
    again = dptrain("train", "--config", str(project / "run" / "config.yaml"), "--out", "again", cwd=elsewhere)
    assert again.returncode == 0, again.stderr
    first_model = torch.load(project / "run" / "model.pt", weights_only=True)
    second_model = torch.load(elsewhere / "again" / "model.pt", weights_only=True)
    assert all(torch.equal(first_model[key], second_model[key]) for key in first_model)


def test_existing_run_directory_is_refused_and_left_untouched(digits_runs):
    run_dir, _ = digits_runs["allreduce"]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = dptrain("train", *DIGITS, "--out", str(run_dir), cwd=run_dir.parent)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "holds a finished run" in result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_one_worker_runs_in_process_and_communicates_nothing(tmp_path):
    result = dptrain("train", *DIGITS, "--epochs", "3", "--workers", "1", "--strategy", "sync", "--out", "one",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["comm_bytes"] == 0 and summary["launcher"] == "single"


def test_torchrun_world_is_joined_not_respawned(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun ships with torch"
    result = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "dptrain", "train", *DIGITS, "--epochs", "4", "--strategy", "allreduce", "--workers", "5",
         "--timeout", "60", "--out", "tr"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "tr" / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["workers"] == 2
    assert summary["test_accuracy"] >= 0.85
    config = (tmp_path / "tr" / "config.yaml").read_text()
    assert "workers: 2" in config


MISBEHAVING_MODEL = """
import os, signal
from torch import nn

class Misbehaving(nn.Module):
    \"\"\"Rank 1 misbehaves at its 30th training step, as FAIL_HOW says: kill, raise or stop.\"\"\"

    def __init__(self, input_shape, num_outputs):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, num_outputs))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training  # training steps only: the check of averages evaluates too
        if os.environ.get("RANK") == "1" and self.training and self.calls == 30:
            how = os.environ["FAIL_HOW"]
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: only a timeout can notice
            else:
                raise RuntimeError("boom in the user's model")
        return self.net(x)

def make(input_shape, num_outputs):
    return Misbehaving(input_shape, num_outputs)
"""


def misbehave(tmp_path, how: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`dptrain train` on digits whose rank 1 fails in the way `how` names."""
    (tmp_path / "misbehaving_model.py").write_text(textwrap.dedent(MISBEHAVING_MODEL))
    return dptrain("train", *DIGITS, "--model", "misbehaving_model:make", *args, cwd=tmp_path,
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
                        "FAIL_HOW": how}, timeout=timeout)


@pytest.mark.parametrize("how,expected", [("kill", "worker rank 1 was killed by SIGKILL"),
                                          ("raise", "worker rank 1 exited with code 1")])
def test_a_failing_worker_stops_the_run_with_a_line_naming_it(tmp_path, how, expected):
    result = misbehave(tmp_path, how, "--strategy", "allreduce", "--timeout", "20", "--out", "fail")
    assert result.returncode != 0
    assert expected in result.stderr
    assert not (tmp_path / "fail" / "summary.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a GPU"),
    (["--batch-size", "5000"], "--batch-size 5000 is larger than a worker's shard"),
    (["--dataset", "digitz"], "digitz"),
    (["--data", "missing.npz"], "missing.npz"),
    (["--model", "resnet", "--model-option", "depth=9"], "depth"),
    (["--model", "nosuchpkg.mod:make"], "nosuchpkg.mod"),
    (["--workers", "0"], "--workers"),
    (["--loss", "mse"], "--loss mse does not fit"),
])
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path, args, message):
    result = dptrain("train", *DIGITS, *args, "--out", "bad", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain: error:"), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "bad").exists()


def test_a_frozen_worker_is_named_after_the_timeout_instead_of_a_hang(tmp_path):
    result = misbehave(tmp_path, "stop", "--strategy", "allreduce", "--timeout", "8", "--out", "frozen")
    assert result.returncode != 0
    assert "rank 0:" in result.stderr and "rank 1 stopped responding" in result.stderr, result.stderr[-2000:]
    assert "worker rank 0 exited with code 1" in result.stderr


@pytest.mark.parametrize("strategy", ["sync"])  # an average would spread the NaN: the case that matters
def test_a_run_whose_weights_become_nan_stops_with_one_line_per_rank_and_no_summary(tmp_path, strategy):
    result = dptrain("train", *DIGITS, "--lr", "1e4", "--strategy", strategy, "--workers", "2", "--no-progress",
                     "--out", "run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "diverged" in line]
    assert said and all(line.endswith("the weights became NaN or infinite (training loss nan); lower --lr, clip "
                                      "gradients (--grad-clip) or warm up (--warmup-epochs)") for line in said)
    assert "training diverged in epoch 1" in said[0]
    assert not (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / "model.pt").exists()
