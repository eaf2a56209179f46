"""A model and a container runtime are each one file plus one registry line (docs/architecture.md,
"Where a change belongs"): toys written here into a temporary package, registered in-process, are
trained with and launched with; nothing else of dptrain changes. (The scheduler's toy is in
tests/test_toy_scheduler.py, the data source's in tests/test_data_kinds.py, the strategy's in
tests/test_strategy_options.py.)"""

from __future__ import annotations

import json

import pytest

from dptrain import registry
from dptrain.cli import dispatch as dptrain, main

TOY_MODEL = '''
"""A two-layer network whose hidden width is an option (--model-option width=N)."""

from torch import nn


def tiny(input_shape, num_outputs, *, width: int = 8):
    features = 1
    for size in input_shape:
        features *= size
    return nn.Sequential(nn.Flatten(), nn.Linear(features, width), nn.ReLU(), nn.Linear(width, num_outputs))
'''

TOY_RUNTIME = '''
"""A toy runtime: `toyrun IMAGE -- COMMAND` per rank, after one line that checks it is installed."""

from typing import Mapping, Sequence

from dptrain.cluster.spec import JobSpec, quote, train_command

IMAGE = "IMAGE.toy"


def running_inside(env: Mapping[str, str]) -> bool:
    return "TOYRUN_CONTAINER" in env


def preamble(spec: JobSpec) -> list[str]:
    return ["command -v toyrun >/dev/null || { echo 'toyrun is not installed' >&2; exit 2; }"]


def wrap(spec: JobSpec) -> str:
    return f"toyrun {quote([spec.container.image])} -- {quote(train_command(spec))}"


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list:
    return [("toyrun installed", False, "not on this machine")]
'''


@pytest.fixture
def toys(tmp_path, monkeypatch):
    package = tmp_path / "toys"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tiny.py").write_text(TOY_MODEL)
    (package / "toyrun.py").write_text(TOY_RUNTIME)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(registry.MODELS, "tiny", registry.Entry("toys.tiny:tiny", "a toy two-layer network"))
    monkeypatch.setitem(registry.CONTAINER_RUNTIMES, "toyrun", registry.Entry("toys.toyrun", "a toy runtime"))
    return tmp_path


def test_a_registered_model_trains_with_its_own_option(toys, capsys):
    code = dptrain(["train", "--dataset", "digits", "--model", "tiny", "--model-option", "width=5", "--workers", "1",
                    "--epochs", "2", "--no-progress", "--checkpoint-every", "0", "--out", "run"])
    capsys.readouterr()
    assert code == 0
    summary = json.loads((toys / "run" / "summary.json").read_text())
    # 64 inputs -> 5 hidden -> 10 classes: 64*5 + 5 + 5*10 + 10 parameters, trained above chance
    assert summary["model_parameters"] == 64 * 5 + 5 + 5 * 10 + 10
    assert summary["test_accuracy"] > 0.5


def test_a_registered_container_runtime_wraps_every_rank(toys, capsys):
    code = dptrain(["launch", "--scheduler", "slurm", "--nodes", "2", "--tasks-per-node", "2", "--container",
                    "toyrun:img.toy", "--out", "runs/c", "--dry-run", "--", "--dataset", "digits"])
    text = capsys.readouterr().out
    assert code == 0
    assert "command -v toyrun >/dev/null || { echo 'toyrun is not installed' >&2; exit 2; }\n" in text
    assert " rank toyrun img.toy -- dptrain train --dataset digits --out " in text  # each srun task, wrapped


def test_a_bad_container_names_the_registered_runtimes(toys, capsys):
    code = main(["launch", "--scheduler", "slurm", "--container", "docker:x", "--dry-run", "--", "--dataset", "digits"])
    assert code == 2
    assert ("udocker:NAME or apptainer:IMAGE.sif or pyxis:IMAGE or podman:IMAGE or charliecloud:IMAGE_DIR_OR.sqfs "
            "or cscs-edf:IMAGE or toyrun:IMAGE.toy") in capsys.readouterr().err
