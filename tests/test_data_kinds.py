"""The table of data source kinds (dptrain.data.kinds): a new kind is one file and one registration line,
and then `dptrain train` trains on it and `dptrain launch` accepts or refuses its specs through it."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from dptrain.cli import main
from dptrain.data import kinds
from dptrain.data.holdout import HOLD_OUT, hold_out
from dptrain.errors import UserError

# The whole of a new kind: rows of a CSV file, features then an integer label.
CSV_KIND = textwrap.dedent('''
    import numpy as np
    import torch

    from dptrain.data.kinds import Source
    from dptrain.data.user import describe_splits
    from dptrain.errors import UserError


    class CsvFile(Source):
        kind = "csv"
        help = "a .csv file of rows: features, then an integer label"

        def recognises(self, data, base):
            return data is not None and data.endswith(".csv")

        def check(self, data, base):
            if not (base / data).is_file():
                raise UserError(f"--data '{data}' is no CSV file (in {base})")

        def load(self, settings, check_values, log):
            table = np.loadtxt(settings.data, delimiter=",", ndmin=2)
            rows = torch.utils.data.TensorDataset(torch.tensor(table[:, :-1], dtype=torch.float32),
                                                  torch.tensor(table[:, -1], dtype=torch.int64))
            return describe_splits(rows, None, settings.data, f"'{settings.data}' gave no test set", settings.seed,
                                   log, settings.task)
''')


@pytest.fixture
def csv_kind(tmp_path, monkeypatch):
    """The CSV kind registered (in a copy of the table, restored afterwards), run from tmp_path with two
    well-separated blobs of 40 points each in points.csv."""
    (tmp_path / "csv_kind.py").write_text(CSV_KIND)
    spec = importlib.util.spec_from_file_location("csv_kind", tmp_path / "csv_kind.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(kinds, "SOURCES", list(kinds.SOURCES))
    kinds.register_source(module.CsvFile())  # the one line that adds the kind
    rng = np.random.default_rng(0)
    labels = np.arange(80) % 2
    points = rng.standard_normal((80, 2)) + 3.0 * (2 * labels[:, None] - 1)
    np.savetxt(tmp_path / "points.csv", np.column_stack([points, labels]), delimiter=",")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield module
    for signum, handler in handlers.items():  # an in-process training run installs its own
        signal.signal(signum, handler)


def test_the_table_keeps_its_order_of_precedence_and_a_new_kind_goes_before_the_array_files(csv_kind, tmp_path):
    assert [source.kind for source in kinds.SOURCES] == ["factory", "shard pattern", "image folder", "csv",
                                                        "array file", "built-in"]
    assert kinds.find_source("points.csv").kind == "csv"
    assert kinds.find_source("shards/train-{000000..000009}.tar").kind == "shard pattern"
    assert kinds.find_source("tiny.npz").kind == "array file"
    assert kinds.find_source("mypackage.data:make").kind == "factory"
    assert kinds.find_source(None).kind == "built-in"
    with pytest.raises(ValueError, match="registered already"):
        kinds.register_source(csv_kind.CsvFile())
    assert "a .csv file of rows: features, then an integer label; or a file (.npz" in kinds.data_help()


def test_train_trains_on_a_new_kind_with_its_held_out_split_said(csv_kind, tmp_path, capsys):
    code = main(["train", "--data", "points.csv", "--workers", "1", "--epochs", "2", "--batch-size", "8",
                 "--lr", "0.1", "--no-progress", "--checkpoint-every", "0", "--out", "run"])

    out = capsys.readouterr().out
    assert code == 0
    assert ("dptrain: 'points.csv' gave no test set: holding out 16 of its 80 samples (20%, chosen by the seed) "
            "for testing") in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and sum(worker["samples"] for worker in records[0]["workers"]) == 64
    # config.yaml records the file absolutely (the default of Source.absolute), to repeat the run from anywhere
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"] == str(tmp_path / "points.csv")


def test_launch_accepts_and_refuses_specs_of_a_new_kind_through_it(csv_kind, tmp_path, capsys):
    assert main(["launch", "--scheduler", "local", "--dry-run", "--", "--data", "points.csv", "--out", "job"]) == 0
    assert "--data points.csv" in capsys.readouterr().out

    assert main(["launch", "--scheduler", "local", "--dry-run", "--", "--data", "lines.csv", "--out", "job"]) == 2
    assert capsys.readouterr().err.strip() == f"dptrain: error: --data 'lines.csv' is no CSV file (in {tmp_path})"
    assert not (tmp_path / "job").exists()


def test_launch_checks_the_built_in_kinds_as_before(tmp_path):
    (tmp_path / "nets.py").write_text("")
    (tmp_path / "tiny.npz").write_bytes(b"")  # exists: launch reads no data
    for accepted in (None, "tiny.npz", "mypackage.data:make", f"{tmp_path}/nets.py:make"):
        kinds.check_spec(accepted, tmp_path)
    with pytest.raises(UserError, match=rf"^--data 'nope.npz' does not exist \(in {tmp_path}\); give a data file"):
        kinds.check_spec("nope.npz", tmp_path)
    with pytest.raises(UserError, match=r"^--data ./gone.py:make: the file './gone.py' does not exist"):
        kinds.check_spec("./gone.py:make", tmp_path)


def test_one_hold_out_rule_for_every_source():
    kept, held = hold_out(10, seed=3)
    order = np.random.default_rng(3).permutation(10)
    assert HOLD_OUT == 0.2 and held.tolist() == order[:2].tolist() and kept.tolist() == order[2:].tolist()
    # rounding to none: Datasets and image folders hold out one; array files refuse (sources._split)
    assert len(hold_out(2, seed=0)[1]) == 0 and len(hold_out(2, seed=0, at_least_one=True)[1]) == 1


def test_a_config_module_import_reads_the_table_without_numpy_or_torch():
    import subprocess
    code = ("import sys; import dptrain.config, dptrain.launch.commands; "
            "print(sorted(name for name in ('numpy', 'torch') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(Path(kinds.__file__).parents[2]), "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
