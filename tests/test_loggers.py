"""Live logging while a run trains: metrics.csv always, TensorBoard, MLflow and W&B through their own libraries.

Each run is a real `dptrain train` (two workers); what each library wrote is read back with that library's
own reader (TensorBoard's EventAccumulator, MLflow's client) and compared with metrics.jsonl, epoch by epoch.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.errors import UserError
from dptrain.train import loggers

ROOT = Path(__file__).resolve().parents[1]
RUN = ["train", "--dataset", "digits", "--workers", "2", "--epochs", "3", "--no-progress", "--out", "run"]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_", "MLFLOW_", "WANDB_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _train(tmp_path: Path, *args: str, **env: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "dptrain", *RUN, *args], cwd=tmp_path, env=_env(**env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_metrics_csv_is_written_always_one_row_per_epoch_as_metrics_jsonl(tmp_path):
    records = _train(tmp_path)
    with open(tmp_path / "run" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    for row, record in zip(rows, records):
        for key in ("train_loss", "test_loss", "test_accuracy", "lr", "comm_bytes"):
            assert float(row[key]) == pytest.approx(record[key], rel=1e-12), key


def test_tensorboard_events_hold_each_epochs_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _train(tmp_path, "--tensorboard")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert {"train_loss", "test_loss", "test_accuracy", "lr", "comm_bytes"} <= set(events.Tags()["scalars"])
    for tag in ("train_loss", "test_accuracy", "comm_bytes"):
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [step for step, _ in logged] == [1, 2, 3]
        assert [value for _, value in logged] == pytest.approx([r[tag] for r in records], rel=1e-6)  # float32


def test_mlflow_gets_each_epochs_metrics_and_the_runs_settings(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own local store, read back here

    store = tmp_path / "mlruns"
    records = _train(tmp_path, "--log-to", "mlflow", MLFLOW_TRACKING_URI=f"file:{store}", MLFLOW_ALLOW_FILE_STORE="true")
    client = MlflowClient(tracking_uri=f"file:{store}")
    (run,) = client.search_runs(experiment_ids=["0"])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["workers"] == "2" and run.data.params["strategy"] == "allreduce"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert history == [(r["epoch"], pytest.approx(r["train_loss"], rel=1e-12)) for r in records]


def test_wandb_offline_records_each_epochs_metrics(tmp_path):
    records = _train(tmp_path, "--log-to", "wandb", WANDB_MODE="offline", WANDB_SILENT="true")
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    # the history records carry each value as JSON text (W&B's own encoding of a logged number)
    for record in records:
        assert json.dumps(record["train_loss"]).encode() in data
        assert json.dumps(record["test_accuracy"]).encode() in data


def test_a_missing_library_or_unknown_logger_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as where the package is not installed
    with pytest.raises(UserError, match=r"^--tensorboard needs the tensorboard package: pip install tensorboard$"):
        loggers.check(["tensorboard"])
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"^--log-to mlflow needs the mlflow package: pip install mlflow$"):
        loggers.check(["mlflow"])
    with pytest.raises(UserError, match=r"^logger 'neptune' is not one of tensorboard, mlflow, wandb$"):
        loggers.check(["neptune"])


def test_a_bad_log_to_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dptrain", *RUN, "--log-to", "neptune"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--log-to" in done.stderr and "must be mlflow, wandb or both" in done.stderr and "neptune" in done.stderr
    assert not (tmp_path / "run").exists()


def test_mlflow_that_cannot_start_is_one_line_before_any_epoch(tmp_path):
    store = tmp_path / "mlruns"
    done = subprocess.run([sys.executable, "-m", "dptrain", *RUN, "--log-to", "mlflow"], cwd=tmp_path,
                          env=_env(MLFLOW_TRACKING_URI=f"file:{store}"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--log-to mlflow: mlflow could not start logging this run: " in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no epoch trained
