"""TrainConfig in sections, each strategy option declared once (issue 33): the flags and YAML keys stay.

The settings are declared by concern (dptrain.config.SECTIONS) and a strategy's options in its rules only
(dptrain.strategies.rules); TrainConfig is all of them in one flat model. What users type must not notice:
every flag of `dptrain train` and every key of a YAML file (as flags and keys were when the sections came,
and as docs/reference/cli.md lists them) lands on the same setting as before, and no option is declared
twice.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import yaml

from dptrain import config as config_module
from dptrain import registry
from dptrain.arguments import train_config
from dptrain.config import FIELDS, SECTIONS, TrainConfig, build_config, flag_of, resolve
from dptrain.strategies.rules import StrategyRules

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "src" / "dptrain" / "strategies" / "rules"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"

# Every setting of `dptrain train` when it came in sections: {key: (the other flags it needs, the value as
# typed after its flag, the value it sets)}. A key typed in a YAML file ("key: value") sets the same.
# A new setting is added here; one removed or renamed would break users' flags and files.
EVERY_SETTING = {
    # data
    "dataset": ([], "synthetic-images", "synthetic-images"),
    "data": ([], "pkg.mod:factory", "pkg.mod:factory"),
    "task": (["--data", "pkg.mod:factory"], "regress", "regress"),
    "samples": (["--dataset", "synthetic-images"], "100", 100),
    "image_size": (["--dataset", "synthetic-images"], "8", 8),
    "augment": (["--data", "IMAGES"], None, True),
    "channels": (["--dataset", "synthetic-images"], "1", 1),
    "classes": (["--dataset", "synthetic-images"], "3", 3),
    "features": (["--dataset", "synthetic-regression"], "4", 4),
    "block_size": ([], "16", 16),
    "shuffle": ([], "block", "block"),
    "loader_workers": ([], "1", 1),
    "stage_to": (["--data", "shards/train-{000000..000009}.tar"], "local", "local"),
    # model
    "model": ([], "cnn", "cnn"),
    "model_options": ([], "width=4", {"width": 4}),
    "loss": ([], "mse", "mse"),
    # optimizer
    "batch_size": ([], "8", 8),
    "optimizer": ([], "adam", "adam"),
    "lr": ([], "0.1", 0.1),
    "momentum": ([], "0.5", 0.5),
    "nesterov": ([], None, True),
    "weight_decay": ([], "0.01", 0.01),
    "lr_schedule": ([], "step", "step"),
    "lr_step_epochs": ([], "3", 3),
    "lr_gamma": ([], "0.5", 0.5),
    "warmup_epochs": ([], "0.5", 0.5),
    "lr_scaling": ([], "sqrt", "sqrt"),
    "scale_lr": ([], None, True),
    "grad_clip": ([], "1.5", 1.5),
    # strategy
    "strategy": ([], "sync", "sync"),
    "compression": ([], "bf16", "bf16"),
    "sync_every": (["--strategy", "sync"], "2", 2),
    "sync_every_steps": (["--strategy", "streaming"], "5", 5),
    "optimizer_state": (["--strategy", "fedavg"], "reset", "reset"),
    "outer": (["--strategy", "sync"], "nesterov", "nesterov"),
    "outer_lr": (["--strategy", "sync", "--outer", "sgd"], "0.3", 0.3),
    "outer_momentum": (["--strategy", "sync"], "0.5", 0.5),
    "outer_betas": (["--strategy", "fedavg", "--outer", "adam"], "0.8,0.9", (0.8, 0.9)),
    "outer_eps": (["--strategy", "sync"], "0.01", 0.01),
    "allreduce_epochs": (["--strategy", "sync"], "2", 2),
    "auto_candidates": (["--strategy", "auto"], "all", "all"),
    "overlap_steps": (["--strategy", "streaming"], "2", 2),
    "fragments": (["--strategy", "streaming"], "2", 2),
    "ranks_per_node": (["--strategy", "hierarchical"], "2", 2),
    "merge": (["--strategy", "async"], "ema", "ema"),
    "server_momentum": (["--strategy", "async"], "0.8", 0.8),
    "server_lr": (["--strategy", "async"], "0.5", 0.5),
    "max_staleness": (["--strategy", "async"], "3", 3),
    "partition": (["--strategy", "fedavg"], "dirichlet", "dirichlet"),
    "alpha": (["--strategy", "fedavg"], "0.3", 0.3),
    "local_epochs": (["--strategy", "fedavg"], "2", 2),
    "clients_per_round": (["--strategy", "fedavg"], "0.5", 0.5),
    "proximal_mu": (["--strategy", "fedavg"], "0.1", 0.1),
    "min_workers": ([], "1", 1),
    "commit_every_steps": (["--min-workers", "1"], "3", 3),
    # sharding
    "shard": ([], "full", "full"),
    "shard_size": (["--shard", "hybrid"], "2", 2),
    "shard_unit": (["--shard", "full"], "Block", "Block"),
    "shard_precision": (["--shard", "full"], "bf16", "bf16"),
    "shard_offload": (["--shard", "full"], None, True),
    "shard_checkpoint": (["--shard", "full"], None, True),
    # run
    "epochs": ([], "3", 3),
    "amp": ([], "bf16", "bf16"),
    "seed": ([], "3", 3),
    "device": ([], "cpu", "cpu"),
    "timeout": ([], "10", 10.0),
    "slow_worker": ([], "1:2.5", "1:2.5"),
    "checkpoint_every": ([], "2", 2),
    "checkpoint_every_steps": ([], "5", 5),
    "keep_checkpoints": ([], "3", 3),
    "resume": (["--out", "OUT"], None, True),
    "resume_with_changed_data": ([], None, True),
    "out": ([], "OUT", "OUT"),
    "stop_on_collapse": ([], None, True),
    "progress": ([], "no", False),  # --no-progress
    "accumulate": ([], "4", 4),
    "monitor": ([], "test_accuracy", "test_accuracy"),
    "early_stop_patience": ([], "3", 3),
    "tensorboard": ([], None, True),
    "log_to": ([], "mlflow,wandb", "mlflow,wandb"),
    # membership
    "workers": ([], "4", 4),
    "replace_workers": (["--min-workers", "1"], None, True),
    "max_workers": (["--min-workers", "1"], "5", 5),
    "max_restarts": ([], "2", 2),
    "grace": ([], "4", 4.0),
    "nnodes": (["--master", "node0:29400"], "2", 2),
    "node_rank": (["--nnodes", "3", "--master", "node0:29400"], "2", 2),
    "master": (["--nnodes", "2"], "node0:29400", "node0:29400"),
}


@pytest.fixture
def places(tmp_path):
    """The words IMAGES (an image folder) and OUT (a run directory) of EVERY_SETTING, as paths in tmp_path."""
    images = tmp_path / "images"
    for label in ("a", "b"):
        (images / label).mkdir(parents=True)
        (images / label / "0.png").write_bytes(b"")
    return {"IMAGES": str(images), "OUT": str(tmp_path / "out")}


def _placed(value, places):
    return places.get(value, value) if isinstance(value, str) else value


def _flags(key: str, typed) -> list[str]:
    """The command-line words that set `key` to `typed` (None: a switch; "no": its --no- form)."""
    if key == "model_options":
        return ["--model-option", typed]
    if typed is None:
        return [flag_of(key)]
    if typed == "no" and FIELDS[key].annotation is bool:
        return ["--no-" + key.replace("_", "-")]
    return [flag_of(key), typed]


def _yaml_value(key: str, typed, expected):
    """What a YAML file writes for the setting (a switch: true or false)."""
    if key == "model_options" or typed is None or FIELDS[key].annotation is bool or isinstance(expected, str):
        return expected  # text as text: YAML reads an unquoted 1:2.5 as the base-60 number 62.5
    return yaml.safe_load(typed)


def test_every_setting_of_train_is_in_the_table_and_in_one_section():
    assert set(EVERY_SETTING) == set(FIELDS)
    sections = [key for section in SECTIONS.values() for key in section.model_fields]
    assert sorted(sections) == sorted(FIELDS), "each TrainConfig field is in exactly one section"
    assert list(SECTIONS) == ["data", "model", "optimizer", "strategy", "sharding", "run", "membership"]


@pytest.mark.parametrize("key", list(EVERY_SETTING))
def test_every_flag_lands_on_the_same_setting(key, places):
    context, typed, expected = EVERY_SETTING[key]
    args = [_placed(word, places) for word in [*context, *_flags(key, typed)]]
    config = train_config(args)
    assert getattr(config, key) == _placed(expected, places)
    assert key in config.model_fields_set


@pytest.mark.parametrize("spelling", ["key_with_underscores", "key-with-dashes"])
@pytest.mark.parametrize("key", list(EVERY_SETTING))
def test_every_yaml_key_lands_on_the_same_setting(key, spelling, places, tmp_path):
    context, typed, expected = EVERY_SETTING[key]
    values = {}
    for flag, value in zip(context[::2], context[1::2]):
        values[flag.removeprefix("--").replace("-", "_")] = yaml.safe_load(_placed(value, places))
    values[key] = _placed(_yaml_value(key, typed, expected), places)
    if key == "model_options":  # the flag's own spelling is a key too
        values = {"model_option": values.pop(key)}
    if spelling == "key-with-dashes":
        values = {name.replace("_", "-"): value for name, value in values.items()}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    config = resolve(str(path), {})
    assert getattr(config, key) == _placed(expected, places)


def test_workers_min_max_still_sets_the_membership():
    config = train_config(["--workers", "2:4"])
    assert (config.workers, config.min_workers, config.replace_workers) == (4, 2, True)


def _reference_flags() -> set[str]:
    """The flags docs/reference/cli.md shows for `dptrain train` (its section of the page)."""
    text = CLI_PAGE.read_text()
    train = text.split("## `dptrain train`", 1)[1]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", train))


def test_every_flag_of_the_reference_page_is_a_setting_tested_here():
    flags = _reference_flags() - {"--help", "--config"}
    assert len(flags) > 20, "docs/reference/cli.md's `dptrain train` section lost its table"
    tested = {flag_of(key) for key in EVERY_SETTING} | {"--model-option", "--no-progress"}
    tested |= {"--no-" + key.replace("_", "-") for key in EVERY_SETTING if FIELDS[key].annotation is bool}
    assert sorted(flags - tested) == []


def _option_classes() -> set[type]:
    """Every Options class of the registered strategies and the option classes they inherit."""
    classes = set()
    for name in registry.names("strategy"):
        for cls in registry.load("strategy rules", name).Options.__mro__:
            if isinstance(cls, type) and issubclass(cls, StrategyRules.Options):
                classes.add(cls)
    return classes


def test_each_strategy_option_is_declared_once_in_the_rules():
    declared: dict[str, list[str]] = {}
    for cls in _option_classes():
        for option in cls.__dict__.get("__annotations__", {}):
            declared.setdefault(option, []).append(f"{cls.__module__}.{cls.__qualname__}")
    twice = {option: where for option, where in declared.items() if len(where) > 1}
    assert twice == {}, f"options declared more than once: {twice}"
    for option in declared:
        assert option in SECTIONS["strategy"].model_fields, option


def _class_fields(path: Path) -> dict[str, list[str]]:
    """{name: ['file:Class', ...]} of every annotated name in a class body of `path`."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.setdefault(item.target.id, []).append(f"{path.name}:{node.name}")
    return found


def test_no_strategy_option_is_declared_in_config_py_or_twice_in_the_rules_files():
    options = {option for name in registry.names("strategy")
               for option in registry.load("strategy rules", name).option_names()}
    in_config = _class_fields(Path(inspect.getsourcefile(config_module)))
    assert sorted(options & set(in_config)) == [], "strategy options declared in config.py"
    in_rules: dict[str, list[str]] = {}
    for path in sorted(RULES.glob("*.py")):
        for option, where in _class_fields(path).items():
            in_rules.setdefault(option, []).extend(where)
    twice = {option: where for option, where in in_rules.items()
             if option in options and len([w for w in where if not w.endswith(":OuterSettings")]) > 1}
    assert twice == {}, f"strategy options declared in more than one rules class: {twice}"
    assert all(option in in_rules for option in options)


def test_the_strategy_section_is_made_of_the_rules_declarations():
    strategy = SECTIONS["strategy"].model_fields
    for name in registry.names("strategy"):
        for option, field in registry.load("strategy rules", name).Options.model_fields.items():
            assert repr(strategy[option]) == repr(field) == repr(FIELDS[option]), option
            assert field.description, f"{name}'s option {option} has no --help text"


def test_a_section_of_a_config_holds_its_settings():
    config = build_config({"strategy": "sync", "sync_every": 2, "optimizer": "adam", "epochs": 3})
    assert config.section("strategy").sync_every == 2
    assert config.section("optimizer").optimizer == "adam" and config.section("optimizer").lr == config.lr
    assert config.section("run").epochs == 3
    assert isinstance(config, TrainConfig) and config.compression == "none"


def test_train_help_lists_each_flag_under_its_section():
    from dptrain.arguments import Parser, add_config_flags

    parser = Parser(prog="dptrain train")
    add_config_flags(parser)
    groups = {group.title: {flag for action in group._group_actions for flag in action.option_strings}
              for group in parser._action_groups}
    for key in FIELDS:
        flag = "--model-option" if key == "model_options" else flag_of(key)
        assert flag in groups[config_module.section_of(key)], (key, config_module.section_of(key))
