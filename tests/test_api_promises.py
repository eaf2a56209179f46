"""The Python API keeps the command's promises: a user's mistake through Trainer, fit and dptrain.run is one line
and exit code 2 without a traceback (DPTRAIN_DEBUG=1 shows it), the run directory is refused as `dptrain train`
refuses it (finished, busy, another command's run) and continued with resume=True, and a data factory's labels are
checked as an array file's are."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import dptrain
from dptrain.data.user import describe_splits, load_user_data
from dptrain.errors import UserError
from dptrain.train.rundir import MARKER, lock_run_dir
from test_api import _env

# A user's script: one mistake (argv[1]) made through Trainer or fit, with or without dptrain.run (argv[2]).
MISTAKES = textwrap.dedent("""
    import sys
    import torch
    import dptrain
    from torch.utils.data import Dataset, TensorDataset

    class Triples(Dataset):
        def __len__(self):
            return 40
        def __getitem__(self, index):
            return torch.zeros(8), 0, 1

    def main(mistake):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
        model = torch.nn.Linear(8, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss, strategy, train = "cross-entropy", dptrain.Sync(), (x, y)
        if mistake == "strategy-name":
            strategy = "sync"
        elif mistake == "loss-name":
            loss = "crossentropy"
        elif mistake == "other-model":
            optimizer = torch.optim.SGD(torch.nn.Linear(8, 3).parameters(), lr=0.1)
        elif mistake == "negative-labels":
            train = TensorDataset(x, y - 1)
        elif mistake == "triples":
            train = Triples()
        trainer = dptrain.Trainer(model, optimizer, loss, strategy, batch_size=8, verbose=False, progress=False)
        trainer.fit(train, epochs=1)

    if __name__ == "__main__":
        if sys.argv[2] == "run":
            dptrain.run(main, sys.argv[1])
        main(sys.argv[1])
""")

NAMED = {
    "strategy-name": "strategy 'sync' is a name, not a Strategy: pass dptrain.Sync()",
    "loss-name": "unknown loss 'crossentropy'; did you mean 'cross-entropy'?",
    "other-model": "the optimizer (SGD) holds none of the model's parameters",
    "negative-labels": "the training data passed to fit has negative class label -1; labels must be 0..C-1.",
    "triples": "of the training Dataset is a tuple of 3 values; each item must be an (x, y) pair",
}


def _script(tmp_path, text: str, *args: str, env: dict | None = None, timeout: float = 120):
    (tmp_path / "script.py").write_text(text)
    return subprocess.run([sys.executable, "script.py", *args], cwd=tmp_path, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mistake", sorted(NAMED))
@pytest.mark.parametrize("how", ["plain", "run"])
def test_a_mistake_through_trainer_or_fit_is_one_line_and_exit_code_2(tmp_path, mistake, how):
    done = _script(tmp_path, MISTAKES, mistake, how)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("dptrain: error: ") and NAMED[mistake] in done.stderr


def test_dptrain_debug_shows_the_traceback_before_the_line(tmp_path):
    env = {**_env(), "DPTRAIN_DEBUG": "1"}
    done = _script(tmp_path, MISTAKES, "strategy-name", "plain", env=env)
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "api_checks.py" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("dptrain: error: strategy 'sync' is a name")
    other = _script(tmp_path, "import dptrain\nraise KeyError('mine')\n")  # not a UserError: Python's own ending
    assert other.returncode == 1 and "Traceback" in other.stderr and "KeyError: 'mine'" in other.stderr


def test_mistakes_raise_user_errors_that_are_also_the_value_and_type_errors_python_code_expects():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unknown loss 'crossentropy'") as raised:
        dptrain.Trainer(model, optimizer, "crossentropy")
    assert isinstance(raised.value, UserError)
    with pytest.raises(TypeError, match="strategy Sync is the class; pass an instance, Sync()") as raised:
        dptrain.Trainer(model, optimizer, "cross-entropy", dptrain.Sync)
    assert isinstance(raised.value, UserError)
    with pytest.raises(ValueError, match="amp must be one of"):
        dptrain.Trainer(model, optimizer, amp="fp8")
    # an optimizer over part of the model (fine-tuning a head) is the user's choice
    head = torch.optim.SGD(list(model.parameters())[1:], lr=0.1)
    dptrain.Trainer(model, head)


# -- the run directory ---------------------------------------------------------------------------------
RUN = textwrap.dedent("""
    import sys
    import torch
    import dptrain
    from torch.utils.data import TensorDataset

    def main(out, epochs, resume):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy",
                                  dptrain.Sync(), batch_size=8, out=out, resume=resume == "resume",
                                  checkpoint_every=1, verbose=False, progress=False)
        trainer.fit((x[:48], y[:48]), (x[48:], y[48:]), epochs=int(epochs))

    if __name__ == "__main__":
        dptrain.run(main, *sys.argv[1:])
""")


def _epochs(out) -> list[int]:
    return [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_second_fit_into_a_finished_run_is_refused_in_one_line_and_changes_nothing(tmp_path):
    out = tmp_path / "runs" / "api"
    assert _script(tmp_path, RUN, str(out), "2", "new").returncode == 0
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "model.pt")}
    done = _script(tmp_path, RUN, str(out), "2", "new")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"dptrain: error: run directory '{out}' holds a finished run (summary.json); "
                                   "give out= a new directory")
    assert {name: (out / name).read_bytes() for name in before} == before
    assert _epochs(out) == [1, 2]
    # resume=True trains a finished run on from its checkpoints, each epoch recorded once
    assert _script(tmp_path, RUN, str(out), "3", "resume").returncode == 0
    assert _epochs(out) == [1, 2, 3] and json.loads((out / "summary.json").read_text())["epochs"] == 3


def test_resume_does_not_start_a_finished_run_without_checkpoints_over(tmp_path):
    out = tmp_path / "no-checkpoints"
    script = RUN.replace("checkpoint_every=1", "checkpoint_every=0")
    assert _script(tmp_path, script, str(out), "1", "new").returncode == 0
    before = (out / "summary.json").read_bytes()
    done = _script(tmp_path, script, str(out), "2", "resume")
    assert done.returncode == 2 and "holds a finished run (summary.json)" in done.stderr
    assert (out / "summary.json").read_bytes() == before


def test_a_stopped_run_is_refused_without_resume_and_continued_with_it(tmp_path):
    out = tmp_path / "stopped"
    # resume=True where there is no run starts one, so that the same script starts and continues it
    killed = _script(tmp_path, RUN, str(out), "3", "resume", env={**_env(), "DPTRAIN_FAULT": "train-middle@0:2"})
    assert killed.returncode != 0 and not (out / "summary.json").exists() and _epochs(out) == [1]
    refused = _script(tmp_path, RUN, str(out), "3", "new")
    # (the killed run left its lock file: taking the lock over is said, as for `dptrain train`)
    lines = [line for line in refused.stderr.strip().splitlines() if "taking over run directory" not in line]
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "holds an unfinished run (metrics.jsonl, checkpoints); pass resume=True to continue it" in refused.stderr
    assert _epochs(out) == [1]
    continued = _script(tmp_path, RUN, str(out), "3", "resume")
    assert continued.returncode == 0, continued.stderr
    assert _epochs(out) == [1, 2, 3] and json.loads((out / "summary.json").read_text())["epochs"] == 3


def test_a_busy_run_directory_is_refused_in_one_line(tmp_path):
    out = tmp_path / "busy"
    with lock_run_dir(str(out)):
        done = _script(tmp_path, RUN, str(out), "1", "new")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"run directory '{out}' is in use by another dptrain run" in done.stderr
    assert "give out= another directory" in done.stderr and not (out / "metrics.jsonl").exists()


def test_a_run_of_dptrain_train_is_refused_by_the_api_and_a_folder_of_other_files_too(tmp_path):
    cli_run = tmp_path / "cli"
    cli_run.mkdir()
    (cli_run / MARKER).write_text("a dptrain run directory\n")
    (cli_run / "config.yaml").write_text("strategy: allreduce\n")
    (cli_run / "metrics.jsonl").write_text('{"epoch": 1}\n')
    done = _script(tmp_path, RUN, str(cli_run), "1", "resume")
    assert done.returncode == 2 and "holds a run of `dptrain train` (config.yaml)" in done.stderr, done.stderr
    assert (cli_run / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    done = _script(tmp_path, RUN, str(project), "1", "new")
    assert done.returncode == 2 and "holds files that are not a dptrain run (notes.txt)" in done.stderr
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]


# -- a data factory's labels, checked as an array file's ---------------------------------------------
def _factory_file(tmp_path, body: str) -> str:
    (tmp_path / "mydata.py").write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset

        def make():
    """) + textwrap.indent(textwrap.dedent(body), "    "))
    return f"{tmp_path / 'mydata.py'}:make"


def test_a_factorys_negative_labels_are_named_in_one_line_as_an_array_files_are(tmp_path):
    labels = np.array([0, 1, 2, -1] * 10)
    np.savez(tmp_path / "d.npz", x=np.zeros((40, 8), np.float32), y=labels)
    spec = _factory_file(tmp_path, "return TensorDataset(torch.zeros(40, 8), torch.tensor([0, 1, 2, -1] * 10)), None")
    said_by = {}
    for name, data in (("file", str(tmp_path / "d.npz")), ("factory", spec)):
        done = subprocess.run([sys.executable, "-m", "dptrain", "train", "--data", data, "--model", "mlp",
                               "--workers", "1", "--epochs", "1", "--out", str(tmp_path / f"run-{name}")],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        said_by[name] = done.stderr.strip()
    assert said_by["file"].endswith("has negative class label -1; labels must be 0..C-1.")
    assert said_by["factory"] == (f"dptrain: error: --data {spec}: the training Dataset has negative class label -1; "
                                  "labels must be 0..C-1.")


def test_a_factory_returning_none_is_named_in_one_line(tmp_path):
    spec = _factory_file(tmp_path, "return None")
    with pytest.raises(UserError, match=r"returned None as its train set; return \(train, test\) map-style Datasets"):
        load_user_data(spec, seed=0, log=lambda line: None)


class Unlabelled(Dataset):
    """Items only: the labels are known by reading them."""

    def __init__(self, y):
        self.y = y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return torch.zeros(4), self.y[index]


def test_labels_from_1_and_gaps_are_said_and_a_test_label_beyond_trainings_refused():
    said = []
    splits = describe_splits(Unlabelled([1, 2, 3, 1, 2, 3]), Unlabelled([1, 2]), "mine.py:make", "", 0,
                             said.append, "auto")
    assert splits.num_classes == 4
    assert [line for line in said if "warning" in line] == [
        "dptrain: warning: --data mine.py:make: the training Dataset has no sample of class 0 (classes 0..3: the "
        "largest label + 1) (labels from 1 leave class 0 empty); the model's output for it trains towards nothing: "
        "number the classes 0..C-1 with no gaps"]
    said.clear()
    describe_splits(Unlabelled([0, 2, 5, 0, 2, 5]), None, "mine.py:make", "", 0, said.append, "auto")
    assert any("has no sample of class 1, 3, 4 (classes 0..5" in line for line in said)
    with pytest.raises(UserError, match=r"the test Dataset has class label 7 but .* only goes up to 2"):
        describe_splits(TensorDataset(torch.zeros(6, 4), torch.tensor([0, 1, 2] * 2)),
                        TensorDataset(torch.zeros(2, 4), torch.tensor([7, 0])), "mine.py:make", "", 0,
                        lambda line: None, "auto")


def test_an_array_files_labels_from_1_are_said_in_the_same_words(tmp_path):
    from dptrain.data.sources import load_dataset

    np.savez(tmp_path / "d.npz", x=np.zeros((40, 4), np.float32), y=np.array([1, 2, 3, 1] * 10))
    said = []
    load_dataset(None, data_path=str(tmp_path / "d.npz"), check_values=True, log=said.append)
    assert [line for line in said if "warning" in line] == [
        f"dptrain: warning: array 'y' in '{tmp_path / 'd.npz'}' has no sample of class 0 (classes 0..3: the largest "
        "label + 1) (labels from 1 leave class 0 empty); the model's output for it trains towards nothing: number "
        "the classes 0..C-1 with no gaps"]
