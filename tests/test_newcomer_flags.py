"""Frictions a newcomer met (issue 24): settings that do not apply are refused by one rule, `launch` refuses
before it writes, a run records what it used, the help says which command to use, the LR line names its rule."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from dptrain import lr_policy, registry
from dptrain.cli import build_parser, main
from dptrain.config import FIELDS, build_config, resolve, to_yaml
from dptrain.data.holdout import HOLD_OUT
from dptrain.strategies.rules.outer import OUTER_LR_DEFAULTS, outer_settings


def _error(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    np.savez(tmp_path / "x.npz", x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    return tmp_path


# -- one rule for settings that do not apply ---------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--strategy", "sync", "--partition", "dirichlet"], "--partition applies to strategy fedavg, not sync"),
    (["--strategy", "allreduce", "--sync-every", "2"],
     "--sync-every applies to strategies sync, streaming, async and hierarchical, not allreduce"),
    (["--strategy", "allreduce", "--sync-every", "1"],  # given, even at its default: it does nothing here
     "--sync-every applies to strategies sync, streaming, async and hierarchical, not allreduce"),
    (["--strategy", "allreduce", "--local-epochs", "2"], "--local-epochs applies to strategy fedavg, not allreduce"),
    (["--strategy", "fedavg", "--merge", "ema"], "--merge applies to strategy async, not fedavg"),
    (["--strategy", "sync", "--proximal-mu", "0.1"], "--proximal-mu applies to strategy fedavg, not sync"),
    (["--strategy", "allreduce", "--outer", "adam"], "--outer applies to strategies sync and fedavg, not allreduce"),
    (["--strategy", "auto", "--sync-every", "2"],
     "--sync-every applies to strategies sync, streaming, async and hierarchical, not auto"),
    (["--strategy", "streaming", "--compression", "fp16"],
     "--compression applies to strategies allreduce, sync, async, fedavg and auto, not streaming"),
    (["--data", "x.npz", "--image-size", "16"],
     "--image-size applies to --data as an image folder and --dataset synthetic-images, not --data 'x.npz' "
     "(an array file)"),
    (["--data", "x.npz", "--dataset", "digits"], "--dataset applies to built-in data (no --data), not --data "
                                                 "'x.npz' (an array file)"),
    (["--dataset", "digits", "--channels", "1"], "--channels applies to --dataset synthetic-images, not --dataset digits"),
    (["--dataset", "synthetic-images", "--features", "4"],
     "--features applies to --dataset synthetic-regression, not --dataset synthetic-images"),
    (["--strategy", "sync", "--sync-every", "2", "--sync-every-steps", "10"],
     "invalid settings in the command line: sync_every 2 and sync_every_steps 10 both set how often to average; "
     "give one of them"),
])
def test_a_setting_that_does_not_apply_is_refused_in_one_line(args, message, in_tmp, capsys):
    code = main(["train", "--workers", "1", "--epochs", "1", "--out", "out", *args])
    assert (code, _error(capsys)) == (2, [f"dptrain: error: {message}"])
    assert sorted(path.name for path in in_tmp.iterdir()) == ["x.npz"]  # nothing written


def test_defaults_are_never_refused_and_every_strategy_accepts_its_own_options():
    for name in registry.names("strategy"):
        config = build_config({"strategy": name})  # every other strategy's options at their defaults
        rules = registry.load("strategy rules", name)
        given = {option: getattr(config, option) for option in rules.option_names()
                 if getattr(config, option) is not None}
        assert build_config({"strategy": name, **given}).strategy == name
    # auto builds its pick from the same settings: theirs apply to it, but not the period it chooses itself.
    assert build_config({"strategy": "auto", "optimizer_state": "reset", "outer": "nesterov"}).outer == "nesterov"
    assert build_config({"strategy": "auto", "auto_candidates": "all", "merge": "ema"}).merge == "ema"
    with pytest.raises(Exception, match="^key 'merge' in the settings applies to strategy async, not auto$"):
        build_config({"strategy": "auto", "merge": "ema"})  # its safe candidates never pick async
    assert build_config({"data": "pkg.mod:factory", "task": "regress"}).task == "regress"
    assert build_config({"dataset": "synthetic-images", "channels": 1, "image_size": 8}).channels == 1


def test_a_config_file_repeats_its_run_and_older_full_files_still_load(tmp_path, in_tmp):
    path = tmp_path / "run.yaml"
    for values in ({"strategy": "allreduce"}, {"strategy": "sync", "outer": "nesterov", "sync_every": 2},
                   {"strategy": "fedavg", "partition": "dirichlet"}, {"strategy": "auto"},
                   {"strategy": "async", "merge": "ema"}, {"dataset": "synthetic-images", "channels": 1},
                   {"data": str(in_tmp / "x.npz")}):
        config = build_config(values)
        path.write_text(to_yaml(config))
        assert resolve(str(path), {}) == config, values
    # A config.yaml of an older dptrain lists every setting, at its default where it did not apply.
    old = build_config({"strategy": "allreduce"}).model_dump(mode="json") | {"outer_lr": 0.7}
    path.write_text(yaml.safe_dump(old))
    assert resolve(str(path), {}).outer_lr is None
    # A file's key away from its default, where it does not apply, is refused as a flag is.
    path.write_text("strategy: sync\npartition: dirichlet\n")
    with pytest.raises(Exception, match=rf"^key 'partition' in '{path}' applies to strategy fedavg, not sync$"):
        resolve(str(path), {})


def test_a_run_records_what_it_used(in_tmp):
    recorded = yaml.safe_load(to_yaml(build_config({"data": str(in_tmp / "x.npz")})))
    assert recorded["data"] == str(in_tmp / "x.npz")
    assert not {"dataset", "channels", "classes", "samples", "features", "image_size"} & set(recorded)
    assert not {"outer", "partition", "merge", "sync_every"} & set(recorded)  # allreduce reads none of them
    sync = build_config({"strategy": "sync"})
    assert sync.outer_lr is None and yaml.safe_load(to_yaml(sync))["outer_lr"] is None  # none has no outer LR
    assert build_config({"strategy": "sync", "outer": "nesterov"}).outer_lr == OUTER_LR_DEFAULTS["nesterov"]
    assert outer_settings("none").outer_lr is None  # what Sync(), FedAvg() and their summaries record
    assert "0.7 for none" not in FIELDS["outer_lr"].description


def test_the_summary_records_the_data_as_loaded(in_tmp):
    from dptrain.data.kinds import load_data
    from dptrain.train.command import data_record

    config = build_config({"data": "x.npz"})
    assert data_record(config, load_data(config, log=lambda line: None)) == {
        "source": str(in_tmp / "x.npz"), "task": "classification", "input_shape": [3], "classes": 2,
        "train_samples": 16, "test_samples": 4}


# -- launch refuses before it writes ------------------------------------------------------------------

def test_launch_submit_without_the_submit_tool_writes_nothing(in_tmp, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(in_tmp / "empty"))
    code = main(["launch", "--scheduler", "slurm", "--submit", "--out", "run", "--", "--dataset", "digits"])
    assert (code, _error(capsys)) == (2, ["dptrain: error: sbatch is not on the PATH; --submit needs it to submit "
                                          "the job: run this where sbatch works, or leave --submit out to only "
                                          "write the job script"])
    assert not (in_tmp / "run").exists()


@pytest.mark.parametrize("after", [[], ["--"]])
def test_launch_with_nothing_to_run_is_refused(after, in_tmp, capsys):
    code = main(["launch", "--scheduler", "slurm", "--out", "run", *after])
    assert (code, _error(capsys)) == (2, ["dptrain: error: nothing to run after '--'; give dptrain train's "
                                          "arguments (e.g. -- --dataset digits --epochs 3) or a command (e.g. -- "
                                          "python train.py)"])
    assert not (in_tmp / "run").exists()


# -- help ------------------------------------------------------------------------------------------------

def _help(*words: str) -> str:
    parser = build_parser(only=words[0] if words else None)
    if not words:
        return parser.format_help()
    commands = next(action for action in parser._actions if hasattr(action, "choices") and action.choices
                    and "train" in action.choices)
    return commands.choices[words[0]].format_help()


def test_the_help_says_which_command_to_use_and_what_data_takes():
    top = _help()
    for line in ("  train    a model from the zoo", "  run      your own training script", "  launch   either of them",
                 "  Python   import dptrain"):
        assert line in top, line
    assert "Train the built-in digits data set twice" in _help("demo")
    assert "Print what dptrain detects here" in _help("info")
    data = " ".join(_help("train").split())
    assert f"or one Dataset ({HOLD_OUT:.0%} held out for testing)".replace("%", " %") in data
    assert "(default: 0.7 for nesterov as DiLoCo, 1 for sgd as FedAvgM, 0.01 for adam; none has no outer learning " \
           "rate)" in data


# -- the LR line ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, said", [
    ({}, "learning rate 0.05 (0.05 x 1, --lr-scaling none, the default)"),
    ({"lr_scaling": "sqrt"}, "learning rate 0.1 (0.05 x 2, --lr-scaling sqrt)"),
    ({"scale_lr": True}, "learning rate 0.2 (0.05 x 4, --scale-lr, i.e. --lr-scaling linear)"),
    ({"lr_scaling": "auto", "sync_every_steps": 4},
     "learning rate 0.05 (0.05 x 1, --lr-scaling auto, which keeps the LR of sync)"),
])
def test_the_lr_line_names_the_rule_in_effect(values, said):
    line = lr_policy.lr_line(build_config({"strategy": "sync", "lr": 0.05, **values}), 4)
    assert line == f"dptrain: sync on 4 workers trains with {said}; --lr-scaling none keeps 0.05"
