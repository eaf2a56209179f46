"""A catalogue of bad inputs: each exits with code 2, prints one line naming the bad value, and changes nothing on disk.

Every case runs `dptrain` on files it made in a sandbox directory (a good data file, an
`out/` directory already holding a note, and whatever the case adds: a broken data file, a
user model module, a real run directory it then damages). The sandbox is snapshotted
(names, bytes and mtimes) before the command and compared after. Cases that fail in the
launching process run in-process through `dptrain.cli.main`; with `--workers 1` training
runs in-process too, so only the case that needs spawned workers uses a subprocess.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import yaml

from cli_runner import run_dptrain as run_dptrain_process
from dptrain.cli import main

GOOD_DATA = "tiny.npz"
FACTORIES = "dptrain_bad_input_factories"  # user model module written into the sandbox
FACTORIES_SOURCE = '''
from torch import nn


def boom(input_shape, num_outputs):
    raise ValueError("width must be even")


def three_outputs(input_shape, num_outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
'''
OLD_NS = 1_000_000_000 * 10**9  # 2001-09-09: any write during the test gives a later mtime


def tiny_arrays(n: int = 40) -> dict[str, np.ndarray]:
    """4 features, labels 0/1: trains in a fraction of a second."""
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32), "y": np.arange(n, dtype=np.int64) % 2}


def train(*extra: str, data: str = GOOD_DATA, workers: str = "2", out: str = "out") -> list[str]:
    """`dptrain train` on the tiny data; later flags in `extra` override these."""
    return ["train", "--data", data, "--workers", workers, "--epochs", "1", "--batch-size", "4", "--out", out, *extra]


def launch(*options: str) -> list[str]:
    return ["launch", *options, "--", "--data", GOOD_DATA, "--out", "out"]


# ------------------------------------------------------------------------ real runs to damage


def _run_in_process(argv: list[str], cwd: Path) -> None:
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(cwd)
            patch.setenv("DPTRAIN_DEBUG", "0")
            assert main(argv) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory) -> Path:
    """Two finished 1-worker, 1-epoch runs on the tiny data: `run` (mlp) and `other` (an mlp of another width)."""
    root = tmp_path_factory.mktemp("trained")
    np.savez(root / GOOD_DATA, **tiny_arrays())
    _run_in_process(train(workers="1", out="run"), root)
    _run_in_process(train("--model-option", "hidden=[8]", workers="1", out="other"), root)
    return root


@dataclass
class Sandbox:
    """The directory a case runs in, with helpers that write the inputs it needs."""

    root: Path
    request: pytest.FixtureRequest

    def path(self, name: str) -> Path:
        return self.root / name

    def write(self, name: str, text: str) -> str:
        self.path(name).write_text(text)
        return name

    def npz(self, name: str, **arrays: np.ndarray) -> str:
        np.savez(self.path(name), **arrays)
        return name

    def h5(self, name: str, **arrays: np.ndarray) -> str:
        with h5py.File(self.path(name), "w") as handle:
            for key, array in arrays.items():
                handle.create_dataset(key, data=array)
        return name

    def npy_dir(self, name: str, **arrays: np.ndarray) -> str:
        self.path(name).mkdir()
        for key, array in arrays.items():
            np.save(self.path(name) / f"{key}.npy", array)
        return name

    def user_model(self, factory: str) -> str:
        """`--model` for `factory` in a module of user factories written into the sandbox (on sys.path)."""
        self.write(f"{FACTORIES}.py", FACTORIES_SOURCE)
        return f"{FACTORIES}:{factory}"

    def finished_run(self) -> Path:
        """A copy of the real finished mlp run, as `run` in the sandbox, on the sandbox's data (config.yaml
        names the data by its absolute path)."""
        run = Path(shutil.copytree(self.request.getfixturevalue("trained_runs") / "run", self.path("run")))
        config = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(yaml.safe_dump({**config, "data": str(self.path(GOOD_DATA))},
                                                        sort_keys=False))
        return run

    def interrupted_run(self) -> Path:
        """The finished mlp run as an interruption leaves it: checkpoints, but no summary.json or model.pt."""
        run = self.finished_run()
        (run / "summary.json").unlink()
        (run / "model.pt").unlink()
        return run

    def other_models_checkpoint(self) -> Path:
        return self.request.getfixturevalue("trained_runs") / "other" / "checkpoints" / "epoch-000001" / "rank-00000.pt"


def write_checkpoint_file(path: Path, data: bytes) -> None:
    """A rank file with a checksum that matches it."""
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(data).hexdigest())


def hand_written_config(s) -> list[str]:
    """A config.yaml the user wrote (no run beside it) is not mistaken for an interrupted run."""
    s.path("mine").mkdir()
    s.write("mine/config.yaml", "epochs: 3\nlr: 0.1\n")
    return train(out="mine")


# ------------------------------------------------------------------------ checkpoint cases


def every_checkpoint_truncated(s: Sandbox) -> list[str]:
    run = s.interrupted_run()
    for rank_file in run.glob("checkpoints/*/rank-*.pt"):
        rank_file.write_bytes(rank_file.read_bytes()[:100])
    return train("--resume", workers="1", out="run")


def checkpoint_of_another_model(s: Sandbox) -> list[str]:
    run = s.interrupted_run()
    for rank_file in run.glob("checkpoints/*/rank-*.pt"):
        write_checkpoint_file(rank_file, s.other_models_checkpoint().read_bytes())
    return train("--resume", workers="1", out="run")


def unreadable_checkpoint_with_matching_checksum(s: Sandbox) -> list[str]:
    run = s.interrupted_run()
    for rank_file in run.glob("checkpoints/*/rank-*.pt"):
        write_checkpoint_file(rank_file, b"not a torch file")
    return train(workers="1", out="run")  # no --resume: an unfinished run with the same settings continues anyway


def two_worker_checkpoint_of_another_model(s: Sandbox) -> list[str]:
    run = s.interrupted_run()
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "workers": 2}, sort_keys=False))
    epoch = run / "checkpoints" / "epoch-000001"
    shutil.rmtree(run / "checkpoints")
    epoch.mkdir(parents=True)
    for rank in (0, 1):
        write_checkpoint_file(epoch / f"rank-{rank:05d}.pt", s.other_models_checkpoint().read_bytes())
    return train("--resume", workers="2", out="run")


def interrupted_run_without_checkpoints(s: Sandbox) -> list[str]:
    shutil.rmtree(s.interrupted_run() / "checkpoints")
    return train("--resume", workers="1", out="run")


def interrupted_run_with_broken_config(s: Sandbox, *extra: str, command: str = "train") -> list[str]:
    """An interrupted run whose config.yaml was damaged by hand (a key without its colon on line 2)."""
    run = s.interrupted_run()
    lines = (run / "config.yaml").read_text().splitlines(keepends=True)
    (run / "config.yaml").write_text(lines[0] + "epochs 3\n  lr: [0.1\n" + "".join(lines[1:]))
    return [command, "run"] if command != "train" else train(*extra, workers="1", out="run")


def interrupted_run_with_other_lr(s: Sandbox) -> list[str]:
    s.interrupted_run()
    return train("--lr", "0.1", workers="1", out="run")


def rewrite_checkpoint_states(run: Path, change: Callable[[dict], None]) -> None:
    """Load each rank file of `run`, `change` its state, save it back with a matching checksum."""
    import torch

    for rank_file in run.glob("checkpoints/*/rank-*.pt"):
        state = torch.load(rank_file, weights_only=True)
        change(state)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_checkpoint_file(rank_file, buffer.getvalue())


def checkpoint_without_optimizer(s: Sandbox) -> list[str]:
    rewrite_checkpoint_states(s.interrupted_run(), lambda state: state.pop("optimizer"))
    return train("--resume", workers="1", out="run")


def checkpoint_with_nan_weights(s: Sandbox) -> list[str]:
    def poison(state: dict) -> None:
        next(iter(state["model"].values())).view(-1)[0] = float("nan")

    rewrite_checkpoint_states(s.interrupted_run(), poison)
    return train(workers="1", out="run")  # no --resume: continuing an unfinished run loads it too


# ------------------------------------------------------------------------ the catalogue


@dataclass(frozen=True)
class Case:
    make: Callable[[Sandbox], list[str]]  # writes what the case needs into the sandbox; returns the argv
    names: tuple[str, ...]  # substrings the error line must contain: the bad value, where it is
    subprocess: bool = False


def case(id: str, make: Callable[[Sandbox], list[str]], *names: str, subprocess: bool = False, xfail: str = ""):
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=xfail)] if xfail else []
    if subprocess:
        marks.append(pytest.mark.slow)
    return pytest.param(Case(make, names, subprocess), id=id, marks=marks)


def arrays_with(**changes: np.ndarray) -> dict[str, np.ndarray]:
    return {**tiny_arrays(), **changes}


def with_nan() -> np.ndarray:
    x = tiny_arrays()["x"]
    x[3, 1] = np.nan
    return x


def with_label(index: int, label: int) -> np.ndarray:
    y = tiny_arrays()["y"]
    y[index] = label
    return y


CASES = [
    # config
    case("config-yaml-unknown-key", lambda s: train("--config", s.write("run.yaml", "learning_rate: 0.1\n")),
         "unknown key 'learning_rate'", "run.yaml", "did you mean 'lr'"),
    case("config-yaml-wrong-type", lambda s: train("--config", s.write("run.yaml", "momentum: high\n")),
         "--momentum", "'run.yaml'", "'high'"),
    case("config-yaml-invalid-syntax", lambda s: train("--config", s.write("run.yaml", "epochs: [1, 2\n")),
         "'run.yaml' is not valid YAML"),
    case("config-missing-config-file", lambda s: train("--config", "nope.yaml"), "'nope.yaml' does not exist"),
    case("config-flag-wrong-type", lambda s: train("--lr", "fast"), "--lr", "'fast'"),
    case("config-negative-epochs", lambda s: train("--epochs", "-3"), "--epochs must be at least 1 (got -3)"),
    case("config-zero-workers", lambda s: train(workers="0"), "--workers must be at least 1 (got 0)"),
    case("config-batch-larger-than-shard", lambda s: train("--batch-size", "17"),
         "--batch-size 17", "shard of 16 samples"),
    case("config-unknown-strategy", lambda s: train("--strategy", "gossip"), "--strategy", "'gossip'"),
    case("config-commit-without-min-workers", lambda s: train("--commit-every-steps", "4"),
         "--commit-every-steps 4 needs --min-workers"),
    case("config-commit-under-sync", lambda s: train("--strategy", "sync", "--min-workers", "1",
                                                     "--commit-every-steps", "4"),
         "--commit-every-steps applies to strategy allreduce, not sync"),
    case("config-unknown-flag", lambda s: train("--learning-rate", "0.1"), "--learning-rate", "did you mean --lr"),
    # data
    case("data-missing-file", lambda s: train(data="missing.npz"), "'missing.npz' does not exist"),
    case("data-wrong-keys", lambda s: train(data=s.npz("keys.npz", features=tiny_arrays()["x"],
                                                        labels=tiny_arrays()["y"])),
         "has no array 'x'", "features"),
    case("data-x-y-length-mismatch", lambda s: train(data=s.npz("short.npz", **arrays_with(y=tiny_arrays()["y"][:39]))),
         "40 samples in 'x' but 39 in 'y'"),
    case("data-nan", lambda s: train(data=s.npz("nan.npz", **arrays_with(x=with_nan()))), "array 'x'", "1 NaN"),
    case("data-inf-in-hdf5-test-set",
         lambda s: train(data=s.h5("inf.h5", **tiny_arrays(), x_test=np.full((4, 4), np.inf, np.float32),
                                   y_test=np.zeros(4, np.int64))),
         "array 'x_test'", "'inf.h5'", "16 NaN or infinite"),
    case("data-negative-label", lambda s: train(data=s.npz("neg.npz", **arrays_with(y=with_label(5, -1)))),
         "negative class label -1"),
    case("data-test-label-out-of-range",
         lambda s: train(data=s.npz("range.npz", **tiny_arrays(), x_test=tiny_arrays()["x"][:4],
                                    y_test=np.array([0, 1, 7, 1]))),
         "'y_test'", "class label 7", "up to 1"),
    case("data-fewer-samples-than-workers",
         lambda s: train(data=s.npz("three.npz", **tiny_arrays(3)), workers="3"),
         "2 samples, fewer than the 3 workers"),
    case("data-empty-arrays",
         lambda s: train(data=s.npz("empty.npz", x=np.zeros((0, 4), np.float32), y=np.zeros(0, np.int64))),
         "array 'x'", "is empty"),
    case("data-directory-without-y", lambda s: train(data=s.npy_dir("arrays", x=tiny_arrays()["x"])),
         "'arrays' needs x.npy and y.npy"),
    case("data-boolean-labels", lambda s: train(data=s.npz("bool.npz", **arrays_with(y=tiny_arrays()["y"] > 0))),
         "array 'y'", "dtype bool"),
    # model
    case("model-module-not-found", lambda s: train("--model", "no_such_module_for_dptrain:build"),
         "cannot import module 'no_such_module_for_dptrain'"),
    case("model-attribute-missing",
         lambda s: train("--model", s.user_model("nope")),
         "has no attribute 'nope'", "boom"),
    case("model-factory-raises",
         lambda s: train("--model", s.user_model("boom")),
         f"{FACTORIES}:boom raised ValueError: width must be even"),
    case("model-output-shape-mismatch",
         lambda s: train("--model", s.user_model("three_outputs")),
         "model output shape (2, 3)", "(2, 2)"),
    case("model-file-missing", lambda s: train("--model", "./mymodels.py:make_net"),
         "--model ./mymodels.py:make_net: the file './mymodels.py' does not exist"),
    case("model-file-does-not-import", lambda s: train("--model", f"./{s.write('broken.py', 'def make(:')}:make"),
         "cannot import the file './broken.py' for --model ./broken.py:make: SyntaxError"),
    case("model-unknown-builtin", lambda s: train("--model", "resnett"), "unknown model 'resnett'", "'resnet'"),
    case("model-unknown-option", lambda s: train("--model-option", "depth=3"), "unknown option 'depth'", "'mlp'"),
    case("model-image-model-on-flat-samples", lambda s: train("--model", "cnn"), "model 'cnn'", "(4,)"),
    # checkpoint
    case("checkpoint-every-one-corrupt-with-resume", every_checkpoint_truncated, "corrupt"),
    case("checkpoint-of-another-model", checkpoint_of_another_model, "does not fit this model", "'run'"),
    case("checkpoint-unreadable-with-matching-checksum", unreadable_checkpoint_with_matching_checksum,
         "rank-00000.pt' cannot be read"),
    case("checkpoint-of-another-model-two-workers", two_worker_checkpoint_of_another_model,
         "does not fit this model", subprocess=True),
    case("checkpoint-without-optimizer", checkpoint_without_optimizer, "rank-00000.pt'", "lacks 'optimizer'"),
    case("checkpoint-with-nan-weights", checkpoint_with_nan_weights, "rank-00000.pt'", "non-finite weights"),
    # run directory
    case("rundir-finished-run", lambda s: train(out=s.finished_run().name), "'run' holds a finished run"),
    case("rundir-other-settings", interrupted_run_with_other_lr, "'run'", "lr: 0.02 there, 0.1 now"),
    case("rundir-resume-empty-directory", lambda s: train("--resume"), "'out' holds no run to continue"),
    case("rundir-resume-without-checkpoint", interrupted_run_without_checkpoints, "'run' has no checkpoint yet"),
    case("rundir-broken-config-yaml", interrupted_run_with_broken_config,
         "run settings file 'run/config.yaml' is not valid YAML at line 3, column", "give --out a new directory"),
    case("rundir-broken-config-yaml-on-resume", lambda s: interrupted_run_with_broken_config(s, "--resume"),
         "'run/config.yaml' is not valid YAML at line 3"),
    case("rundir-broken-config-yaml-in-info", lambda s: interrupted_run_with_broken_config(s, command="info"),
         "'run/config.yaml' is not valid YAML at line 3", "'key: value'"),
    case("rundir-broken-config-yaml-in-join", lambda s: interrupted_run_with_broken_config(s, command="join"),
         "'run/config.yaml' is not valid YAML at line 3"),
    case("rundir-out-is-a-file", lambda s: train(out=s.write("taken", "not a directory\n")), "'taken' is a file"),
    case("rundir-holds-other-files", lambda s: train(),
         "--out 'out' holds files that are not a dptrain run (notes.txt); give --out a new or empty directory"),
    case("rundir-hand-written-config", hand_written_config,
         "--out 'mine' holds files that are not a dptrain run (config.yaml); give --out a new or empty directory"),
    # launch
    case("launch-unknown-scheduler", lambda s: launch("--scheduler", "sge"), "--scheduler", "'sge'"),
    case("launch-zero-nodes", lambda s: launch("--scheduler", "slurm", "--nodes", "0"), "--nodes 0"),
    case("launch-udocker-without-image", lambda s: launch("--scheduler", "slurm", "--container", "udocker:"),
         "'udocker:'"),
    case("launch-apptainer-without-image", lambda s: launch("--scheduler", "pbs", "--container", "apptainer:"),
         "'apptainer:'"),
    case("launch-kubernetes-replace-workers", lambda s: [*launch("--scheduler", "kubernetes", "--image", "img"),
                                                         "--min-workers", "1", "--replace-workers"],
         "--replace-workers under --scheduler kubernetes"),
    case("launch-unknown-container-runtime", lambda s: launch("--scheduler", "slurm", "--container", "docker:img"),
         "'docker:img'"),
    case("launch-local-on-two-nodes", lambda s: launch("--scheduler", "local", "--nodes", "2"), "not 2"),
    case("launch-bad-time", lambda s: launch("--scheduler", "slurm", "--time", "2h"), "--time '2h'"),
    case("launch-dptrain-for-a-command", lambda s: launch("--scheduler", "slurm", "--dptrain", "python -m dptrain",
                                                          "--", "sh", "-c", "true"),
         "--dptrain 'python -m dptrain' says how ranks run dptrain train, but this job runs the command 'sh' itself"),
    case("launch-bad-train-arguments", lambda s: [*launch("--scheduler", "slurm"), "--epochs", "0"],
         "--epochs must be at least 1 (got 0)"),
    case("launch-missing-data", lambda s: [*launch("--scheduler", "slurm"), "--data", "nope.npz"],
         "--data 'nope.npz' does not exist"),
    case("launch-missing-model-file", lambda s: [*launch("--scheduler", "pbs"), "--model", "./mymodels.py:make_net"],
         "the file './mymodels.py' does not exist"),
    case("launch-command-not-found", lambda s: ["launch", "--scheduler", "slurm", "--out", "out", "--", "pyhton",
                                                 "train.py"], "command 'pyhton' is not on the PATH"),
    case("launch-command-script-missing", lambda s: ["launch", "--scheduler", "local", "--out", "job", "--",
                                                      sys.executable, "tain.py"], "script 'tain.py' does not exist"),
    case("launch-kubernetes-without-image", lambda s: launch("--scheduler", "kubernetes"), "needs --image IMAGE"),
    case("launch-kubernetes-bad-volume", lambda s: launch("--scheduler", "kubernetes", "--image", "img", "--volume",
                                                          "claim"), "--volume 'claim' is not CLAIM:PATH"),
    case("launch-image-for-slurm", lambda s: launch("--scheduler", "slurm", "--image", "img"),
         "--image img is for --scheduler kubernetes"),
    case("config-model-option-not-yaml", lambda s: train("--model-option", "hidden=[1,2"),
         "--model-option 'hidden=[1,2'", "not valid YAML"),
]


# ------------------------------------------------------------------------ running a case


def snapshot(root: Path) -> dict[str, object]:
    """Every directory, and every file's size, hash and mtime (ns), under root."""
    tree: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_dir():
            tree[name + "/"] = "dir"
        else:
            data = path.read_bytes()
            tree[name] = (len(data), hashlib.sha256(data).hexdigest()[:16], path.stat().st_mtime_ns)
    return tree


def age(root: Path) -> None:
    """Backdate every file, so that a rewrite within the same clock tick still shows in the mtime."""
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, ns=(OLD_NS, OLD_NS))


@pytest.fixture
def sandbox(tmp_path, request, monkeypatch) -> Sandbox:
    root = tmp_path / "sandbox"
    root.mkdir()
    np.savez(root / GOOD_DATA, **tiny_arrays())
    (root / "out").mkdir()
    (root / "out" / "notes.txt").write_text("a note the user keeps next to the run\n")
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield Sandbox(root, request)
    for signum, handler in handlers.items():  # an in-process training run installs its own
        signal.signal(signum, handler)
    sys.modules.pop(FACTORIES, None)


def run_dptrain(argv: list[str], case: Case, root: Path, capsys) -> tuple[int, str]:
    if not case.subprocess:
        code = main(argv)
        return code, capsys.readouterr().err
    result = run_dptrain_process(argv, cwd=root, timeout=180,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "DPTRAIN_DEBUG": "0"})
    return result.returncode, result.stderr


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_exit_2_one_line_naming_it_and_changes_nothing(case: Case, sandbox: Sandbox, capsys):
    argv = case.make(sandbox)
    age(sandbox.root)
    before = snapshot(sandbox.root)
    capsys.readouterr()

    code, stderr = run_dptrain(argv, case, sandbox.root, capsys)

    lines = stderr.splitlines()
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("dptrain: error: "), stderr
    for name in case.names:
        assert name in lines[0]
    assert snapshot(sandbox.root) == before


def test_debug_adds_the_traceback(sandbox: Sandbox, capsys):
    before = snapshot(sandbox.root)

    code = main(["--debug", *train("--strategy", "gossip")])

    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert lines[0] == "Traceback (most recent call last):"
    assert any(line.startswith("dptrain.errors.UserError: ") for line in lines)
    assert lines[-1].startswith("dptrain: error: ") and "'gossip'" in lines[-1]
    assert snapshot(sandbox.root) == before


def test_the_catalogue_has_a_case_for_every_kind_of_input():
    areas = {param.id.split("-")[0] for param in CASES}
    assert areas == {"config", "data", "model", "checkpoint", "rundir", "launch"}
    assert len(CASES) >= 28
