"""The shape of the loop (issue 33): who trains has one owner (train/live.py), the loop fits on one screen, and the
Trainer's keywords of old still work. Read from the source (AST), so that a change that grows the loop back fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[1] / "src" / "dptrain"
TRAINER = SRC / "train" / "trainer.py"
# What only the membership owner may name (words of identifiers and strings): the trainer asks it at the loop's
# boundaries instead.
MEMBERSHIP_WORDS = ("regroup", "join", "joins", "joining", "joiner", "joiners", "store")
LONGEST_FUNCTION = 45


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _code_words(tree: ast.Module) -> set[str]:
    """Every identifier, attribute and string the code uses, docstrings and comments left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


def _functions(root: Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_the_trainer_leaves_membership_to_its_owner():
    tree = _tree(TRAINER)
    imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imports |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "dptrain.runtime.membership" not in imports
    named = sorted(word for word in _code_words(tree)
                   if "min_workers" in word or set(re.split(r"[^a-z]+", word.lower())) & set(MEMBERSHIP_WORDS))
    assert not named, f"train/trainer.py names what train/live.py owns: {named}"


def test_the_loop_fits_on_one_screen():
    lines = len(TRAINER.read_text().splitlines())
    assert lines <= 400, f"train/trainer.py is {lines} lines"
    trainer = next(node for node in ast.walk(_tree(TRAINER)) if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    methods = {node.name: node for node in trainer.body if isinstance(node, ast.FunctionDef)}
    fit = methods["_fit"]
    assert fit.end_lineno - fit.lineno + 1 <= 50
    init = methods["__init__"].args
    parameters = len(init.args) + len(init.kwonlyargs) + bool(init.vararg) + bool(init.kwarg)
    assert parameters <= 12, f"Trainer.__init__ takes {parameters} parameters"


@pytest.mark.parametrize("folder", ["train", "strategies"])
def test_no_function_is_long_or_returns_a_long_tuple(folder):
    long, tuples = [], []
    for path, function in _functions(SRC / folder):
        length = function.end_lineno - function.lineno + 1
        if length > LONGEST_FUNCTION:
            long.append(f"{path.relative_to(SRC)}:{function.name} ({length} lines)")
        returns = function.returns
        if isinstance(returns, ast.Subscript) and getattr(returns.value, "id", "") in ("tuple", "Tuple"):
            items = returns.slice.elts if isinstance(returns.slice, ast.Tuple) else [returns.slice]
            if len(items) > 3 and not any(isinstance(item, ast.Constant) and item.value is Ellipsis for item in items):
                tuples.append(f"{path.relative_to(SRC)}:{function.name}")
        for node in ast.walk(function):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > 3:
                tuples.append(f"{path.relative_to(SRC)}:{function.name}")
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"
    assert not tuples, f"functions returning a tuple of more than 3: {tuples}"


# Every keyword dptrain.Trainer took before its options came in groups, with a value other than its default.
OLD_KEYWORDS = {"batch_size": 7, "schedule": None, "amp": "bf16", "grad_clip": 1.5, "seed": 3, "shuffle": "local",
                "device": "cpu", "timeout": 12.0, "out": "somewhere", "progress": False, "verbose": False,
                "loader_workers": 2, "checkpoint_every": 2, "keep_checkpoints": 5, "resume": True,
                "check_averages": False, "stop_on_collapse": True, "lr_scale": 2.0, "checkpoint_every_steps": 4,
                "min_workers": 1, "max_workers": 3, "lr_rule": None, "commit_every_steps": 2,
                "resume_with_changed_data": True, "tensorboard": True, "log_to": ("mlflow",), "accumulate": 3, "monitor": "test_accuracy",
                "early_stop_patience": 2, "shard": "hybrid", "shard_size": 2, "shard_unit": "Linear",
                "shard_precision": "bf16", "shard_offload": True, "shard_checkpoint": True}


def test_every_keyword_of_old_still_lands_where_it_did():
    from dptrain import Trainer
    from dptrain.train.state import KEYWORDS

    assert set(KEYWORDS) == set(OLD_KEYWORDS)
    model = torch.nn.Linear(2, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), **OLD_KEYWORDS)
    for keyword, value in OLD_KEYWORDS.items():
        group, name = KEYWORDS[keyword]
        assert getattr(getattr(trainer, {"step": "steps", "checks": "check_options"}.get(group, group)), name) == value
    assert trainer.batch_size == 7 and str(trainer.out) == "somewhere" and trainer.resume and trainer.lr_scale == 2.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), batchsize=3)
    with pytest.raises(ValueError, match="max_workers needs min_workers"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), max_workers=3)


def test_option_groups_and_keywords_agree():
    from dptrain import Trainer
    from dptrain.train.state import MembershipOptions, RunOptions, StepOptions

    model = torch.nn.Linear(2, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), step=StepOptions(batch_size=9),
                      run=RunOptions(seed=4), membership=MembershipOptions(min_workers=2), keep_checkpoints=5)
    assert (trainer.batch_size, trainer.seed, trainer.membership.min_workers, trainer.checkpoints.keep) == (9, 4, 2, 5)
    with pytest.raises(TypeError, match="both step= and batch_size="):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), step=StepOptions(), batch_size=3)
