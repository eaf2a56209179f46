"""Every registered name works everywhere it is offered: config, --help, the cost model, builders, backends, the documentation.

Adding a strategy (scheduler, container runtime, model, data set) is its own file plus one
line in dptrain.registry; these tests enumerate the registry, so a new line is checked at once.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from dptrain import registry
from dptrain import costmodel
from dptrain.cli import build_parser
from dptrain.config import build_config
from dptrain.data import load_dataset
from dptrain.errors import UserError
from dptrain.cluster.base import ContainerRuntime, Environment, Scheduler
from dptrain.models import build_model
from dptrain.strategies import Strategy, build_strategy

DOCS = Path(__file__).resolve().parents[1] / "docs"
STRATEGY_PAGE = (DOCS / "how-to" / "strategies.md").read_text()
CALIBRATION = costmodel.Calibration(seconds_per_sample=1e-4, model_bytes=4_000_000, bandwidth=1e8, latency=1e-4,
                                    samples=10_000, batch_size=32)


def train_help() -> str:
    subcommands = next(action for action in build_parser()._actions if action.choices and "train" in action.choices)
    return subcommands.choices["train"].format_help()


def option_help(help_text: str, flag: str) -> str:
    """The help of one option: from its flag to the next option, white space folded."""
    match = re.search(rf"^  {flag} .*?(?=^  --|\Z)", help_text, re.M | re.S)
    assert match, f"no {flag} in the help"
    return " ".join(match.group(0).split())


@pytest.mark.parametrize("name", registry.names("strategy"))
def test_every_strategy_is_accepted_by_the_config_and_offered_in_train_help(name):
    assert build_config({"strategy": name}).strategy == name
    assert f"{name} ({registry.STRATEGIES[name].help})" in option_help(train_help(), "--strategy")


def test_a_strategy_the_registry_lacks_is_refused_with_the_valid_ones():
    with pytest.raises(UserError, match=r"\(--strategy\) must be one of " + ", ".join(registry.names("strategy")) + r" \(got 'gossip'\)"):
        build_config({"strategy": "gossip"})


@pytest.mark.parametrize("name", registry.names("strategy"))
def test_every_strategy_builds_from_its_registry_line(name):
    strategy = build_strategy(build_config({"strategy": name}))
    assert isinstance(strategy, registry.load("strategy", name))
    assert isinstance(strategy, Strategy)


@pytest.mark.parametrize("name", registry.names("strategy"))
def test_every_strategy_is_timed_by_the_cost_model(name):
    assert name in costmodel.STRATEGIES
    assert registry.STRATEGIES[name].communication in costmodel.COMMUNICATION
    alone, four = (costmodel.epoch_seconds(name, n, CALIBRATION) for n in (1, 4))
    assert alone["communication"] == 0 and four["communication"] >= 0  # overlap may hide it all (streaming)
    slow = costmodel.Calibration(**{**CALIBRATION.as_dict(), "bandwidth": 1e6})  # a link nothing can hide
    assert costmodel.epoch_seconds(name, 4, slow)["communication"] > 0
    assert four["total"] == pytest.approx(four["compute"] + four["communication"])


@pytest.mark.parametrize("name", registry.names("strategy"))
def test_every_strategy_has_a_row_in_the_strategy_table_and_a_page_of_its_own(name):
    table = re.search(r"^## The strategies\n(.*?)(?=^## |\Z)", STRATEGY_PAGE, re.M | re.S).group(1)
    assert re.search(rf"^\| `{re.escape(name)}` \|", table, re.M), f"docs/how-to/strategies.md has no row for {name}"
    page = DOCS / "how-to" / f"{name}.md"
    assert page.is_file() and page.read_text().startswith(f"# {name}\n"), f"no page docs/how-to/{name}.md"
    assert f"how-to/{name}.md" in (DOCS.parent / "mkdocs.yml").read_text()


def protocol_members(protocol: type) -> tuple[list[str], dict[str, inspect.Signature]]:
    """(attribute names, {method name: signature without self}) that `protocol` declares."""
    attributes = list(getattr(protocol, "__annotations__", {}))
    methods = {}
    for name, function in vars(protocol).items():
        if inspect.isfunction(function) and not name.startswith("_"):
            signature = inspect.signature(function)
            methods[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return attributes, methods


def assert_satisfies(module, protocol: type) -> None:
    """`module` has every attribute, and every method with every parameter (same name, same kind), of `protocol`."""
    assert isinstance(module, protocol)
    attributes, methods = protocol_members(protocol)
    assert attributes and methods
    types = typing.get_type_hints(protocol)
    for attribute in attributes:
        assert isinstance(getattr(module, attribute), types[attribute]), attribute
    for name, expected in methods.items():
        actual = inspect.signature(getattr(module, name)).parameters
        for parameter in expected.parameters.values():
            assert parameter.name in actual, f"{module.__name__}.{name} lacks parameter {parameter.name}"
            assert actual[parameter.name].kind == parameter.kind, f"{module.__name__}.{name}({parameter.name})"
        extra = [p for p in actual.values() if p.name not in expected.parameters]
        assert all(p.default is not inspect.Parameter.empty for p in extra), f"{module.__name__}.{name}: {extra}"


@pytest.mark.parametrize("name", registry.names("scheduler"))
def test_every_scheduler_module_satisfies_the_scheduler_protocol(name):
    assert_satisfies(registry.load("scheduler", name), Scheduler)


@pytest.mark.parametrize("name", registry.names("launcher"))
def test_every_launcher_module_satisfies_the_environment_protocol(name):
    assert_satisfies(registry.load("launcher", name), Environment)


def test_schedulers_and_launchers_are_asked_in_one_fixed_order_without_ties():
    # Where two launchers' variables are both set the first wins, so the order must not depend on chance.
    modules = [registry.load(kind, name) for kind in ("scheduler", "launcher") for name in registry.names(kind)]
    priorities = [module.PRIORITY for module in modules]
    assert len(set(priorities)) == len(priorities)


@pytest.mark.parametrize("name", registry.names("container runtime"))
def test_every_container_runtime_module_satisfies_the_container_runtime_protocol(name):
    assert_satisfies(registry.load("container runtime", name), ContainerRuntime)


def test_a_module_missing_a_protocol_member_does_not_satisfy_it():
    assert not isinstance(registry.load("container runtime", "udocker"), Scheduler)
    assert not isinstance(registry.load("scheduler", "slurm"), ContainerRuntime)


@pytest.mark.parametrize("name", registry.names("model"))
def test_every_model_builds_and_runs_a_batch(name):
    flat = name.startswith("mlp")
    shape = (12,) if flat else (2, 12) if name == "cnn1d" else (3, 16, 16)
    model = build_model(name, shape, 3)
    assert model(torch.zeros(2, *shape)).shape == (2, 3)


@pytest.mark.parametrize("name", registry.names("dataset"))
def test_every_dataset_loads(name):
    small = {} if name in ("digits", "mnist1d") else {"samples": 40, "image_size": 8}
    data = load_dataset(name, **small)
    assert data.name == name
    assert len(data.x_train) > 0 and len(data.x_test) > 0
    assert data.x_train.shape[1:] == data.input_shape


def test_an_unknown_name_is_one_line_with_a_hint_and_the_valid_names():
    with pytest.raises(UserError, match=r"^unknown scheduler 'slrum'; did you mean 'slurm'\? "
                                        r"valid names are slurm, pbs, local, kubernetes$"):
        registry.load("scheduler", "slrum")


@pytest.mark.parametrize("module", ["dptrain.registry", "dptrain.cli"])
def test_the_registry_and_the_command_line_import_no_torch(module):
    # `dptrain --help` builds every subcommand's parser: it must not pay for importing torch.
    code = f"import sys, {module}; heavy = [m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules]; " \
           "assert not heavy, heavy"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dptrain_help_imports_no_torch_from_start_to_exit():
    code = ("import sys\nfrom dptrain.cli import entry\nsys.argv = ['dptrain', '--help']\n"
            "try:\n    entry()\nfinally:\n    assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: dptrain" in result.stdout
