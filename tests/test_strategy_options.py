"""Each strategy owns its options and rules: config validation asks the chosen strategy, names none itself.

A strategy's rules (dptrain.strategies.rules, no torch) are inherited by its class; a new strategy is
one module plus one registry line, its options and checks included. The outer optimizer's defaults are
one table, so the command line and the Python API build the same outer step.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dptrain import registry
from dptrain.arguments import train_config
from dptrain.config import FIELDS, TrainConfig, build_config
from dptrain.errors import UserError
from dptrain.strategies import FedAvg, Sync, build_strategy
from dptrain.strategies.rules.outer import OUTERS

SRC = Path(__file__).resolve().parents[1] / "src"
OUTER_SETTINGS = ("outer", "outer_lr", "outer_momentum", "outer_betas", "outer_eps")


@pytest.mark.parametrize("outer", OUTERS)
@pytest.mark.parametrize("cls", [Sync, FedAvg])
def test_python_api_and_command_line_resolve_the_same_outer_settings(cls, outer):
    config = train_config(["--strategy", cls.name, "--outer", outer])
    from_cli = build_strategy(config)
    from_python = cls(outer=outer)
    settings = {name: getattr(from_python, name) for name in OUTER_SETTINGS}
    assert settings == {name: getattr(from_cli, name) for name in OUTER_SETTINGS}
    assert settings == {name: getattr(config, name) for name in OUTER_SETTINGS}
    optimizer = from_python.averager.outer
    assert (optimizer.kind, optimizer.lr, optimizer.momentum, tuple(optimizer.betas), optimizer.eps) == (
        outer, config.outer_lr, config.outer_momentum, tuple(config.outer_betas), config.outer_eps)


def test_outer_adam_takes_a_small_outer_lr_from_python_as_on_the_command_line():
    assert Sync(outer="adam").outer_lr == train_config(["--strategy", "sync", "--outer", "adam"]).outer_lr == 0.01
    assert FedAvg(outer="sgd").outer_lr == 1.0  # FedAvgM's server learning rate
    assert Sync(outer="nesterov").outer_lr == 0.7  # DiLoCo's
    assert Sync(outer="adam", outer_lr=0.1).outer_lr == 0.1  # given: kept


@pytest.mark.parametrize("name", registry.names("strategy"))
def test_every_strategys_options_are_train_settings_with_the_same_defaults(name):
    rules = registry.load("strategy rules", name)
    assert issubclass(registry.load("strategy", name), rules)  # the strategy class owns its rules
    for option, field in rules.Options.model_fields.items():
        assert option in FIELDS, f"{name} reads {option}, which is no TrainConfig field"
        assert field.default == FIELDS[option].default, option
    # A default TrainConfig sets each option to its default (outer_lr: resolved from the outer's table).
    options = rules.options(TrainConfig(strategy=name)).model_dump(exclude={"outer_lr"})
    assert options == rules.Options().model_dump(exclude={"outer_lr"})


def test_validating_every_strategy_imports_no_torch():
    code = ("import sys; from dptrain import registry; from dptrain.config import build_config; "
            "[build_config({'strategy': name, 'lr_scaling': 'auto'}).auto_scales() for name in registry.names('strategy')]; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "False"


TOY = '''
"""A toy strategy, its options and rules in this one module: sync's averaging, an even step period only."""

from typing import Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules
from dptrain.strategies.sync import Sync


class Toy(Sync):
    name = "toy"

    class Options(StrategyRules.Options):
        sync_every_steps: Optional[int] = Field(None, ge=1)

    @classmethod
    def check(cls, config):
        if config.sync_every_steps is not None and config.sync_every_steps % 2:
            raise ValueError(f"toy averages every even number of steps, not {config.sync_every_steps}")

    @classmethod
    def scales_lr(cls, config):
        return True

    @classmethod
    def from_config(cls, config):
        return cls(every_steps=config.sync_every_steps)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy strategy of TOY in a temporary module, registered with one line."""
    (tmp_path / "toy_strategy.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.STRATEGIES, "toy",
                        registry.StrategyEntry("toy_strategy:Toy", "a toy", "periodic-allreduce"))
    return registry.load("strategy", "toy")


def test_a_strategy_in_one_module_brings_its_options_and_checks(toy):
    config = build_config({"strategy": "toy", "sync_every_steps": 4, "lr_scaling": "auto", "workers": 4})
    assert config.sync_every_steps == 4
    assert registry.load("strategy rules", "toy") is toy
    assert config.lr_scale(4) == (4.0, "auto")  # its own scales_lr
    built = build_strategy(config)
    assert isinstance(built, toy) and built.every_steps == 4
    with pytest.raises(UserError, match=r"^invalid settings in the settings: toy averages every even number of "
                                        r"steps, not 3$"):
        build_config({"strategy": "toy", "sync_every_steps": 3})
    # The option it shares with others: refused where it does not apply, naming it too.
    with pytest.raises(UserError, match="key 'sync_every_steps' in the settings applies to strategies sync, streaming, hierarchical "
                                        "and toy, not allreduce"):
        build_config({"strategy": "allreduce", "sync_every_steps": 4})
    # Options it does not claim are other strategies' own.
    with pytest.raises(UserError, match="key 'ranks_per_node' in the settings applies to strategy hierarchical, not toy"):
        build_config({"strategy": "toy", "ranks_per_node": 2})
    with pytest.raises(UserError, match="must be one of allreduce, .*, auto, toy"):
        build_config({"strategy": "tyo"})


def test_the_rules_of_a_strategy_are_checked_before_the_settings_hold():
    with pytest.raises(UserError, match="overlap_steps 5 is more than sync_every_steps 4"):
        build_config({"strategy": "streaming", "sync_every_steps": 4, "overlap_steps": 5})
    # Another strategy does not read overlap_steps: given to it, it is refused, not checked.
    with pytest.raises(UserError, match="^key 'overlap_steps' in the settings applies to strategy streaming, not sync$"):
        build_config({"strategy": "sync", "sync_every_steps": 4, "overlap_steps": 5})
