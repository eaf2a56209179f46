"""TrainConfig from YAML and flags: defaults, round trips, precedence, and one-line errors for bad input.

The CLI is called in-process only with arguments that fail before any training starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dptrain import cli
from dptrain.arguments import parse_key_values
from dptrain.config import FIELDS, TrainConfig, build_config, load_yaml, resolve, to_yaml, with_absolute_paths
from dptrain.errors import UserError


@pytest.fixture
def write(tmp_path):
    """write(text) -> path of a YAML file holding text."""
    def _write(text: str, name: str = "run.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return _write


def _user_error(call, *args) -> str:
    with pytest.raises(UserError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- defaults and round trips

def test_defaults_validate():
    config = build_config({})
    assert config == TrainConfig()
    assert (config.strategy, config.dataset, config.workers, config.lr) == ("allreduce", "digits", 2, 0.02)
    assert config.lr_scaling == "none"


def test_no_file_and_no_overrides_gives_the_defaults():
    assert resolve(None, {}) == TrainConfig()


def test_default_config_round_trips_through_yaml(write):
    config = TrainConfig()
    assert build_config(load_yaml(write(to_yaml(config)))) == config


def test_changed_config_round_trips_through_yaml(write):
    config = build_config({
        "strategy": "sync", "sync_every_steps": 5, "optimizer_state": "average", "outer": "nesterov",
        "model": "resnet", "model_options": {"depth": 14, "widths": [16, 32], "norm": None},
        "dataset": None, "data": "/data/x.npz", "samples": 100, "grad_clip": 1.5, "warmup_epochs": 0.5,
        "nesterov": True, "progress": False, "out": "runs/one", "amp": "bf16", "timeout": 12.5,
    })
    again = resolve(write(to_yaml(config)), {})
    assert again == config
    assert again.model_options == {"depth": 14, "widths": [16, 32], "norm": None}


def test_yaml_keys_may_use_dashes(write):
    config = resolve(write("batch-size: 64\nlr-schedule: cosine\n"), {})
    assert (config.batch_size, config.lr_schedule) == (64, "cosine")


def test_yaml_reads_colon_numbers_as_text_not_base_60(write):
    # YAML 1.1 (PyYAML's safe_load) reads 1:3 as 63 and 1:30:00 as 5400; the settings take them as written.
    assert yaml.safe_load("x: 1:3") == {"x": 63}
    config = resolve(write("slow-worker: 1:3\nepochs: 4\nlr: 0.05\n"), {})
    assert (config.slow_worker, config.slow_workers(), config.epochs, config.lr) == ("1:3", {1: 3.0}, 4, 0.05)
    assert parse_key_values(["ratio=2:30", "depth=14"], flag="--model-option", example="depth=14") == {
        "ratio": "2:30", "depth": 14}


def test_empty_yaml_file_gives_the_defaults(write):
    assert resolve(write(""), {}) == TrainConfig()


# ----------------------------------------------------------------------------- flags over file

def test_flags_override_the_file(write):
    path = write("lr: 0.5\nepochs: 3\n")
    config = resolve(path, {"lr": "0.1"})
    assert (config.lr, config.epochs) == (0.1, 3)


def test_none_overrides_are_ignored(write):
    path = write("lr: 0.5\nepochs: 3\n")
    config = resolve(path, {"lr": None, "epochs": None, "nesterov": None})
    assert (config.lr, config.epochs, config.nesterov) == (0.5, 3, False)


@pytest.mark.parametrize("key, text, value", [
    ("epochs", "10", 10), ("batch_size", "7", 7), ("lr", "1e-3", 0.001), ("warmup_epochs", "0.5", 0.5),
    ("nesterov", "true", True), ("progress", "false", False), ("scale_lr", "1", True),
    ("grad_clip", "2", 2.0), ("strategy", "sync", "sync"),
])
def test_flag_strings_are_coerced(key, text, value):
    config = resolve(None, {key: text})
    assert getattr(config, key) == value
    assert type(getattr(config, key)) is type(value)


# ----------------------------------------------------------------------------- one-line errors

def test_unknown_key_suggests_the_close_one(write):
    message = _user_error(resolve, write("batchsize: 8\n"), {})
    assert "'batchsize'" in message and "did you mean 'batch_size'" in message


def test_unknown_key_learning_rate_suggests_lr(write):
    message = _user_error(resolve, write("learning_rate: 0.1\n"), {})
    assert "'learning_rate'" in message and "did you mean 'lr'" in message


def test_unknown_key_with_nothing_close_lists_the_valid_keys(write):
    message = _user_error(resolve, write("zzzz: 1\n"), {})
    assert "'zzzz'" in message and "valid keys are" in message and "batch_size" in message


@pytest.mark.parametrize("text, key, bad, valid", [
    ("epochs: ten\n", "epochs", "'ten'", "must be a whole number"),
    ("epochs: -3\n", "epochs", "-3", "must be at least 1"),
    ("workers: 0\n", "workers", "0", "must be at least 1"),
    ("lr: 0\n", "lr", "0", "must be greater than 0"),
    ("momentum: 1.5\n", "momentum", "1.5", "must be less than 1"),
    ("optimizer: lbfgs\n", "optimizer", "'lbfgs'", "must be one of sgd, adam, adamw"),
    ("batch_size: 2.5\n", "batch_size", "2.5", "must be a whole number"),
    ("slow_worker: fast\n", "slow_worker", "'fast'", "must look like RANK:FACTOR"),
])
def test_bad_value_names_key_value_and_what_is_valid(write, text, key, bad, valid):
    message = _user_error(resolve, write(text), {})
    assert f"key '{key}' in '" in message and "(--" + key.replace("_", "-") + ")" in message
    assert f"(got {bad})" in message and valid in message
    assert "Input should" not in message


def test_bad_strategy_lists_the_strategies(write):
    message = _user_error(resolve, write("strategy: foo\n"), {})
    assert "'foo'" in message and "must be one of allreduce, sync, streaming, async, fedavg" in message


@pytest.mark.parametrize("overrides, expected", [
    ({"workers": "0"}, "--workers must be at least 1 (got 0)"),
    ({"amp": "fp8"}, "--amp must be one of none, bf16, fp16 (got 'fp8')"),
    ({"lr": "0"}, "--lr must be greater than 0 (got 0)"),
])
def test_flag_errors_read_as_one_plain_sentence(overrides, expected):
    assert _user_error(resolve, None, overrides) == expected


def test_yaml_keys_may_use_the_flag_spelling(write):
    config = resolve(write("model-option:\n  width: 8\nbatch-size: 16\n"), {})
    assert config.model_options == {"width": 8} and config.batch_size == 16


def test_bad_flag_value_says_it_came_from_the_command_line():
    message = _user_error(resolve, None, {"epochs": "-3"})
    assert message == "--epochs must be at least 1 (got -3)"


def test_bad_file_value_with_no_flags_given_is_blamed_on_the_file(write):
    message = _user_error(resolve, write("epochs: ten\n"), {"lr": None, "epochs": None})
    assert "command line" not in message


def test_sync_every_steps_needs_strategy_sync(write):
    message = _user_error(resolve, write("strategy: allreduce\nsync_every_steps: 5\n"), {})
    assert "sync_every_steps" in message and "allreduce" in message and "sync" in message
    assert resolve(write("strategy: sync\nsync_every_steps: 5\n"), {}).sync_every_steps == 5


def test_neither_dataset_nor_data_is_an_error(write):
    message = _user_error(resolve, write("dataset: null\n"), {})
    assert "--dataset" in message and "--data" in message


def test_yaml_list_is_not_a_config(write):
    path = write("- lr: 0.1\n- epochs: 3\n")
    message = _user_error(resolve, path, {})
    assert path in message and "mapping" in message and "list" in message


def test_invalid_yaml_is_a_user_error(write):
    path = write("lr: [0.1\nepochs: 3\n")
    message = _user_error(load_yaml, path)
    assert path in message and "not valid YAML" in message


def test_invalid_yaml_says_where(write):
    message = _user_error(load_yaml, write("lr: 0.1\nepochs: 3\n  momentum: 0.8\n"))
    assert "line 3" in message


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    message = _user_error(resolve, path, {"lr": "0.1"})
    assert path in message and "does not exist" in message


# ----------------------------------------------------------------------------- paths in a recorded config

def test_recorded_paths_are_absolute_and_specs_and_names_stay(tmp_path):
    (tmp_path / "tiny.npz").write_bytes(b"")
    (tmp_path / "images").mkdir()
    base = str(tmp_path)
    assert with_absolute_paths({"data": "tiny.npz", "model": "./nets.py:make"}, base) == {
        "data": f"{tmp_path}/tiny.npz", "model": f"{tmp_path}/nets.py:make"}
    assert with_absolute_paths({"data": "images", "model": "sub/nets.py:make", "lr": 0.1}, base) == {
        "data": f"{tmp_path}/images", "model": f"{tmp_path}/sub/nets.py:make", "lr": 0.1}
    # a module spec, a built-in name, no data and absolute paths are left as they are
    for values in ({"data": "pkg.data:make", "model": "mlp"}, {"data": None, "model": "pkg.nets:build"},
                   {"data": "/data/x.npz", "model": "/models/nets.py:make"}, {"data": "missing.npz"}):
        assert with_absolute_paths(values, base) == values


def test_a_run_recorded_with_relative_paths_is_still_continued(tmp_path, monkeypatch):
    from dptrain.train.rundir import open_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.npz").write_bytes(b"")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dptrain-run").write_text("")
    (run / "metrics.jsonl").write_text("")  # it recorded something (a run that recorded nothing is started afresh)
    (run / "config.yaml").write_text(to_yaml(build_config({"data": "tiny.npz", "out": "run"})))  # as before
    settings = with_absolute_paths(build_config({"data": "tiny.npz", "out": "run"}).model_dump(mode="json"))
    assert open_run_dir("run", settings) == (Path("run"), True)


def test_a_run_whose_recorded_data_moved_away_is_continued_with_the_same_file_name(tmp_path, monkeypatch):
    from dptrain.train.rundir import open_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.npz").write_bytes(b"")
    (tmp_path / "other.npz").write_bytes(b"")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dptrain-run").write_text("")
    (run / "metrics.jsonl").write_text("")  # it recorded something (a run that recorded nothing is started afresh)
    recorded = {"data": "/gone/project/tiny.npz", "model": "/gone/project/nets.py:make", "out": "run"}
    (run / "config.yaml").write_text(to_yaml(build_config(recorded)))

    def settings(**values):
        return with_absolute_paths(build_config({**recorded, **values}).model_dump(mode="json"))

    assert open_run_dir("run", settings(data="tiny.npz", model="./nets.py:make")) == (Path("run"), True)
    with pytest.raises(UserError, match=r"other settings \(data: '/gone/project/tiny.npz' there, '.*/other.npz' now"):
        open_run_dir("run", settings(data="other.npz", model="./nets.py:make"))
    with pytest.raises(UserError, match=r"other settings \(model: '/gone/project/nets.py:make' there"):
        open_run_dir("run", settings(data="tiny.npz", model="./nets.py:build"))
    # a recorded file that is still there is the one the run used: another path is other data
    (run / "config.yaml").write_text(to_yaml(build_config({**recorded, "data": str(tmp_path / "other.npz")})))
    with pytest.raises(UserError, match=r"other settings \(data: '.*/other.npz' there, '.*/tiny.npz' now"):
        open_run_dir("run", settings(data="tiny.npz", model="./nets.py:make"))


def test_a_run_recorded_before_a_setting_existed_continues_when_that_setting_is_its_default(tmp_path, monkeypatch):
    from dptrain.train.rundir import open_run_dir

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dptrain-run").write_text("")
    (run / "metrics.jsonl").write_text("")  # it recorded something (a run that recorded nothing is started afresh)
    old = build_config({"dataset": "digits", "strategy": "sync", "out": "run"}).model_dump(mode="json")
    for newer in ("outer_betas", "proximal_mu", "fragments"):  # as config.yaml looked before these existed
        del old[newer]
    (run / "config.yaml").write_text(yaml.safe_dump(old))

    def settings(**values):
        return with_absolute_paths(build_config({"dataset": "digits", "strategy": "sync", "out": "run",
                                                 **values}).model_dump(mode="json"))

    assert open_run_dir("run", settings()) == (Path("run"), True)
    with pytest.raises(UserError, match=r"other settings \(outer_betas: \[0\.9, 0\.99\] there, \[0\.5, 0\.99\] now"):
        open_run_dir("run", settings(outer_betas="0.5,0.99"))


def test_a_run_recorded_before_lr_scaling_continues_with_the_default_and_not_with_auto(tmp_path, monkeypatch):
    from dptrain.train.rundir import open_run_dir

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dptrain-run").write_text("")
    (run / "metrics.jsonl").write_text("")  # it recorded something (a run that recorded nothing is started afresh)
    old = build_config({"dataset": "digits", "strategy": "sync", "out": "run"}).model_dump(mode="json")
    del old["lr_scaling"]
    old["warmup_epochs"] = 0.0  # the default then
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    settings = build_config({"dataset": "digits", "strategy": "sync", "out": "run"}).model_dump(mode="json")
    assert settings["lr_scaling"] == "none"  # the default again since issue 20: what such a run trained with
    assert open_run_dir("run", settings) == (Path("run"), True)
    with pytest.raises(UserError, match=r"other settings \(lr_scaling: 'none' there, 'auto' now\)"):
        open_run_dir("run", {**settings, "lr_scaling": "auto"})


@pytest.mark.parametrize("settings, world, expected", [
    ({"strategy": "sync", "lr_scaling": "auto"}, 4, (4.0, "auto")),
    ({"strategy": "sync", "lr_scaling": "auto", "optimizer": "adam"}, 4, (4.0, "auto")),
    ({"strategy": "async", "optimizer": "adamw", "lr_scaling": "sqrt"}, 9, (3.0, "sqrt")),
    ({"strategy": "streaming", "lr_scaling": "auto"}, 3, (1.0, "none")),  # no check of its averages: no guard
    ({"strategy": "allreduce", "lr_scaling": "auto"}, 4, (1.0, "none")),
    ({"strategy": "fedavg", "lr_scaling": "auto"}, 4, (4.0, "auto")),  # iid partitions: sync with fixed shards
    ({"strategy": "fedavg", "lr_scaling": "auto", "partition": "dirichlet"}, 4, (1.0, "none")),
    ({"strategy": "hierarchical", "lr_scaling": "auto"}, 4, (1.0, "none")),
    ({"strategy": "sync", "lr_scaling": "auto", "sync_every_steps": 4}, 4, (1.0, "none")),  # meets every 4 steps
    ({"strategy": "sync", "lr_scaling": "auto"}, 1, (1.0, "auto")),  # one worker: nothing to scale
    ({"strategy": "sync", "lr_scaling": "none"}, 4, (1.0, "none")),
    ({"strategy": "allreduce", "lr_scaling": "sqrt"}, 16, (4.0, "sqrt")),
    ({"strategy": "allreduce", "scale_lr": True}, 4, (4.0, "linear")),
])
def test_lr_scaling_rules(settings, world, expected):
    assert build_config({"dataset": "digits", **settings}).lr_scale(world) == expected


@pytest.mark.parametrize("settings, world, warmup", [
    ({"strategy": "sync", "lr_scaling": "auto", "epochs": 10}, 2, 1.0),  # auto scaled the LR: a tenth of the run
    ({"strategy": "sync", "lr_scaling": "auto", "epochs": 150}, 2, 5.0),  # at most 5 epochs
    ({"strategy": "sync", "lr_scaling": "auto", "epochs": 10}, 1, 0.0),  # nothing scaled
    ({"strategy": "allreduce", "lr_scaling": "auto", "epochs": 10}, 2, 0.0),
    ({"strategy": "sync", "epochs": 10, "lr_scaling": "linear"}, 2, 0.0),  # explicit rules warm up as told
    ({"strategy": "sync", "epochs": 10, "warmup_epochs": 0}, 2, 0.0),
    ({"strategy": "allreduce", "epochs": 10, "warmup_epochs": 2.5}, 2, 2.5),
])
def test_warmup_rules(settings, world, warmup):
    assert build_config({"dataset": "digits", **settings}).warmup(world) == warmup


def test_scale_lr_contradicting_lr_scaling_is_one_sentence():
    with pytest.raises(UserError, match="scale_lr is short for lr_scaling linear and contradicts lr_scaling sqrt"):
        build_config({"dataset": "digits", "scale_lr": True, "lr_scaling": "sqrt"})


# ----------------------------------------------------------------------------- the CLI

@pytest.fixture
def run_cli(capsys, monkeypatch):
    """run_cli(*argv) -> (exit code, stderr lines); DPTRAIN_DEBUG is restored afterwards."""
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")  # main() sets it to 1 under --debug; setenv undoes that

    def _run(*argv: str) -> tuple[int, list[str]]:
        code = cli.main(list(argv))
        return code, capsys.readouterr().err.splitlines()
    return _run


def _one_error_line(lines: list[str]) -> str:
    assert len(lines) == 1, lines
    assert lines[0].startswith("dptrain: error: ")
    return lines[0]


def test_every_config_field_is_a_train_flag():
    parsed = vars(cli.build_parser().parse_args(["train"]))
    assert set(FIELDS) <= set(parsed)


def test_cli_unknown_flag_is_one_line(run_cli):
    code, lines = run_cli("train", "--lr-rate", "0.1")
    assert code == 2
    assert "--lr-rate" in _one_error_line(lines)


def test_cli_unknown_flag_suggests_lr(run_cli):
    code, lines = run_cli("train", "--lr-rate", "0.1")
    assert code == 2
    assert "did you mean --lr?" in _one_error_line(lines)


def test_cli_unknown_flag_suggests_batch_size(run_cli):
    code, lines = run_cli("train", "--batchsize", "8")
    assert code == 2
    assert "did you mean --batch-size?" in _one_error_line(lines)


def test_cli_negative_epochs(run_cli):
    code, lines = run_cli("train", "--epochs", "-3")
    assert code == 2
    line = _one_error_line(lines)
    assert line == "dptrain: error: --epochs must be at least 1 (got -3)"


def test_cli_model_option_without_equals(run_cli):
    code, lines = run_cli("train", "--model-option", "depth")
    assert code == 2
    line = _one_error_line(lines)
    assert "'depth'" in line and "KEY=VALUE" in line


def test_cli_bad_key_in_config_file(run_cli, write):
    path = write("batchsize: 8\n")
    code, lines = run_cli("train", "--config", path)
    assert code == 2
    assert "did you mean 'batch_size'" in _one_error_line(lines)


def test_cli_missing_config_file(run_cli, tmp_path):
    code, lines = run_cli("train", "--config", str(tmp_path / "nope.yaml"), "--epochs", "1")
    assert code == 2
    assert "does not exist" in _one_error_line(lines)


def test_cli_unknown_command(run_cli):
    code, lines = run_cli("trian")
    assert code == 2
    assert "'trian'" in _one_error_line(lines)


@pytest.mark.parametrize("argv", [
    ("train", "--lr-rate", "0.1"),
    ("train", "--epochs", "-3"),
    ("train", "--model-option", "depth"),
    ("train", "--strategy", "foo"),
])
def test_cli_debug_shows_the_traceback(run_cli, argv):
    code, lines = run_cli("--debug", *argv)
    assert code == 2
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1].startswith("dptrain: error: ")
    assert any("UserError" in line for line in lines)


def test_cli_debug_may_follow_the_command(run_cli):
    code, lines = run_cli("train", "--epochs", "-3", "--debug")
    assert code == 2
    assert "Traceback (most recent call last):" in lines


def test_cli_debug_before_a_launch_command_shows_the_traceback(run_cli):
    code, lines = run_cli("launch", "--scheduler", "slurm", "--debug", "--", "no-such-program-for-dptrain")
    assert code == 2
    assert "Traceback (most recent call last):" in lines and "'no-such-program-for-dptrain'" in lines[-1]
