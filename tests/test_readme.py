"""The README cannot drift: its Python API example runs as printed and every flag it documents exists."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
# Variables that would make the example join a launched job instead of training on its own.
LAUNCHER_VARIABLES = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                                r"DPTRAIN_.*|TORCHELASTIC_.*|OMPI_.*|PMI_.*|MPI_LOCAL.*|SLURM_.*|PBS_.*)$")


def section(title):
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def clean_env():
    env = {key: value for key, value in os.environ.items() if not LAUNCHER_VARIABLES.match(key)}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
def test_python_api_example_trains_digits_to_at_least_85_percent(tmp_path):
    code = re.search(r"```python\n(.*?)```", section("Python API"), re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=clean_env(), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    accuracy = re.findall(r"^test accuracy (\d\.\d+)$", result.stdout, re.M)
    assert len(accuracy) == 1, result.stdout
    assert float(accuracy[0]) >= 0.85


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")  # not the ------ of a table's separator row
# Flags the README shows for other programs' command lines.
FOREIGN_FLAGS = {"--nproc-per-node": "torchrun", "--ntasks": "srun", "--nv": "apptainer", "--allow-root": "udocker",
                 "--signal": "sbatch", "--requeue": "sbatch", "--fault-runs": "pytest", "--fault-report": "pytest",
                 "--save-faults": "pytest", "--logdir": "tensorboard", "--index-url": "pip"}


def table_flags():
    rows = [line for line in README.splitlines() if line.startswith("|")]
    return sorted({flag for row in rows for flag in FLAG.findall(row)})


def parser_flags(parser):
    """Every option string of `parser` and, recursively, of its subcommands."""
    flags = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                flags |= parser_flags(subparser)
    return flags


@pytest.fixture(scope="module")
def dptrain_flags():
    """Flags of `dptrain` and all its subcommands."""
    flags = parser_flags(build_parser())
    assert {"--strategy", "--config", "--nesterov", "--no-nesterov", "--help"} <= flags
    return flags


def test_readme_tables_document_the_main_train_flags():
    assert {"--strategy", "--workers", "--shuffle", "--lr-schedule", "--sync-every"} <= set(table_flags())


def test_every_flag_in_the_readme_tables_is_a_real_flag_of_dptrain_train_or_dptrain(dptrain_flags):
    unknown = [flag for flag in table_flags() if flag not in dptrain_flags | set(FOREIGN_FLAGS)]
    assert not unknown, f"README tables mention flags that dptrain does not have: {unknown}"


def test_every_flag_in_the_readme_prose_and_examples_is_real_too(dptrain_flags):
    unknown = sorted({flag for flag in FLAG.findall(README) if flag not in dptrain_flags | set(FOREIGN_FLAGS)})
    assert not unknown, f"README mentions flags that dptrain does not have: {unknown}"


def test_quick_start_is_make_demo_and_make_test():
    quick_start = section("Quick start")
    assert re.search(r"^make demo\b", quick_start, re.M)
    assert re.search(r"^make test\b", quick_start, re.M)
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
