"""docs/architecture.md: train/, config.py and lr_policy.py have no branch on the kind of strategy (each
strategy's own rules and hooks decide). A comparison with a registered strategy's name there fails."""

from __future__ import annotations

import ast
from pathlib import Path

from dptrain import registry

SRC = Path(__file__).resolve().parents[1] / "src" / "dptrain"
GENERIC = [*sorted((SRC / "train").glob("*.py")), SRC / "config.py", SRC / "lr_policy.py"]


def strategy_comparisons(path: Path, names: set[str]) -> list[str]:
    """`file:line` of each comparison (==, !=, in, not in) of a strategy (an operand whose code says
    `strategy`) with a strategy's name as a string ("auto" is also a value of other settings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for part in (node.left, *node.comparators):
            strings = [part] if isinstance(part, ast.Constant) else getattr(part, "elts", [])
            if any(isinstance(s, ast.Constant) and s.value in names for s in strings) and \
                    any("strategy" in ast.unparse(other) for other in (node.left, *node.comparators)):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_generic_modules_compare_with_no_strategy_name():
    names = set(registry.names("strategy"))
    found = [hit for path in GENERIC for hit in strategy_comparisons(path, names)]
    assert found == [], "branches on a strategy's name:\n" + "\n".join(found)


def test_the_check_sees_a_branch(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(config):\n    if config.strategy == 'sync':\n        return 1\n"
                      "    return config.strategy in ('fedavg', 'x') or config.loss == 'sync'\n")
    assert strategy_comparisons(sample, {"sync", "fedavg"}) == [
        "sample.py:2 config.strategy == 'sync'", "sample.py:4 config.strategy in ('fedavg', 'x')"]  # not config.loss
