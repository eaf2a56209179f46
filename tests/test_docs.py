"""The documentation cannot drift: every example on the site and in the README runs, every flag exists, the site builds.

Every fenced block of README.md and docs/**/*.md is one of:

- a command (```bash) or a program (```python): run, in order, in an empty directory per page, so that
  a later block can use what an earlier one made (a run directory, a data file);
- a file (an HTML comment `<!-- file: NAME -->` just above it): written to NAME there for a later command
  (a YAML file is a config of `dptrain train --config`, and is validated as one);
- text (```text, the ```layers block of docs/architecture.md): output or an illustration, not code;
- not run (`<!-- not-run: REASON -->` just above it): it needs what this machine lacks (a SLURM cluster,
  a GPU, the network) or is this suite itself. These are listed, one skipped test each with its reason,
  and counted, so none is left out silently.

`<!-- expect: REGEX -->` above a run block makes its output (stdout and stderr) match REGEX too.
benchmarks/README.md, shown on the site as the benchmark record, holds the recipes of measurements that
take minutes to hours (some need root for emulated networks): its blocks are listed as not run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dptrain.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RECORD = ROOT / "benchmarks" / "README.md"
RECORD_REASON = "a benchmark recipe of benchmarks/README.md (minutes to hours; emulated networks need root)"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
DIRECTIVE = re.compile(r"^<!-- (not-run|file|expect): (.+?) -->$")
RUN_LANGUAGES = {"bash": "bash", "python": "python"}
TEXT_LANGUAGES = {"text", "layers"}
MOST_NOT_RUN = 16  # the blocks a person must trust without a test; raise it only with a reason on each
# Variables that would make an example join a launched job instead of training on its own.
LAUNCHER_VARIABLES = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                                r"DPTRAIN_.*|TORCHELASTIC_.*|OMPI_.*|PMI_.*|MPI_LOCAL.*|SLURM_.*|PBS_.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    not_run: str = ""
    file: str = ""
    expect: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        """'not-run', 'file', 'text', 'run', or 'unmarked' (a block this suite does not know what to do with)."""
        if self.not_run:
            return "not-run"
        if self.file:
            return "file"
        if self.language in TEXT_LANGUAGES:
            return "text"
        return "run" if self.language in RUN_LANGUAGES else "unmarked"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each with the directives in the HTML comments right above it."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        directives: dict[str, str] = {}
        for above in reversed(text[:match.start()].splitlines()):
            directive = DIRECTIVE.match(above.strip())
            if not directive:
                break
            directives[directive.group(1).replace("-", "_")] = directive.group(2)
        found.append(Block(page, line, match.group(1), match.group(2), **directives))
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
RECORD_BLOCKS = [Block(RECORD, b.line, b.language, b.code, not_run=RECORD_REASON) for b in blocks(RECORD)]
NOT_RUN = [block for block in ALL_BLOCKS if block.kind == "not-run"]
RUN_PAGES = [page for page in PAGES if any(block.kind == "run" for block in blocks(page))]


def test_every_block_is_run_written_text_or_marked_not_run_with_a_reason():
    unmarked = [f"{block.where} (```{block.language})" for block in ALL_BLOCKS if block.kind == "unmarked"]
    assert not unmarked, "blocks that are neither run nor marked (<!-- not-run: REASON --> or <!-- file: NAME -->): " \
                         + ", ".join(unmarked)
    assert all(len(block.not_run.split()) >= 3 for block in NOT_RUN), "say why a block cannot run here"
    assert all(block.language in RUN_LANGUAGES or block.language in ("yaml", "text") for block in ALL_BLOCKS
               if block.kind == "file")
    assert sum(block.kind == "run" for block in ALL_BLOCKS) >= 25


def test_the_blocks_not_run_are_few_and_each_is_listed():
    print(f"\n{len(NOT_RUN)} documentation blocks are not run, and the {len(RECORD_BLOCKS)} benchmark recipes:")
    for block in NOT_RUN + RECORD_BLOCKS[:1]:
        print(f"  {block.where}: {block.not_run}")
    assert 0 < len(NOT_RUN) <= MOST_NOT_RUN
    assert RECORD_BLOCKS


@pytest.mark.parametrize("block", NOT_RUN + RECORD_BLOCKS, ids=lambda block: block.where)
def test_not_run(block: Block):
    pytest.skip(f"not run: {block.not_run}")


def example_env() -> dict[str, str]:
    """This Python's bin directory first on the PATH (dptrain, python), this checkout's src on PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if not LAUNCHER_VARIABLES.match(key)}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
               PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> str:
    if block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.where} exited with {result.returncode}:\n{block.code}\n{output[-4000:]}"
    if block.expect:
        assert re.search(block.expect, output, re.M), f"{block.where}: no match for {block.expect!r} in\n{output[-4000:]}"
    return output


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_the_examples_of_a_page_run_in_order(page: Path, tmp_path):
    env = example_env()
    for block in blocks(page):
        if block.kind == "file":
            (tmp_path / block.file).write_text(block.code)
        elif block.kind == "run":
            run_block(block, tmp_path, env)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "file" and b.language == "yaml"],
                         ids=lambda block: block.where)
def test_a_yaml_file_block_is_a_valid_train_config(block: Block):
    from dptrain.config import build_config

    config = build_config(yaml.safe_load(block.code))
    assert config.epochs >= 1


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**example_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    site = tmp_path / "site"
    assert "Trainer" in (site / "reference" / "api" / "index.html").read_text()
    assert "A run directory in use" in (site / "troubleshooting" / "index.html").read_text()
    assert (site / "benchmarks" / "results" / "100mbit-wide" / "accuracy_vs_time.png").is_file()


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))

    def pages(entries) -> set[str]:
        found = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found |= pages(value) if isinstance(value, list) else {value}
        return found

    on_disk = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md")}
    assert on_disk | {"benchmarks/record.md"} == pages(config["nav"])


# ------------------------------------------------------------------------ flags and the README's promises

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")  # not the ------ of a table's separator row
# Flags the pages show for other programs' command lines.
FOREIGN_FLAGS = {"--nproc-per-node": "torchrun", "--ntasks": "srun", "--nodes": "srun", "--nv": "apptainer",
                 "--allow-root": "udocker", "--signal": "sbatch", "--requeue": "sbatch", "--fault-runs": "pytest",
                 "--fault-report": "pytest", "--save-faults": "pytest", "--logdir": "tensorboard",
                 "--index-url": "pip", "--strict": "mkdocs", "--site-dir": "mkdocs", "--kill-on-bad-exit": "srun",
                 "--overlap": "srun", "--enable-recovery": "mpirun", "--max-np": "horovodrun",
                 "--mail-type": "sbatch", "--gres-flags": "sbatch", "--rdzv-endpoint": "torchrun", "--userns": "podman",
                 "--ipc": "podman", "--cgroup-manager": "podman"}
TEXT = {page: page.read_text() for page in PAGES}


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


def table_flags(text: str) -> set[str]:
    return {flag for line in text.splitlines() if line.startswith("|") for flag in FLAG.findall(line)}


def test_the_tables_document_the_main_train_flags():
    assert {"--strategy", "--workers", "--shuffle", "--lr-schedule", "--sync-every"} <= \
        table_flags(TEXT[ROOT / "docs" / "reference" / "cli.md"]) | table_flags(TEXT[ROOT / "docs" / "how-to" / "sync.md"])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_flag_a_page_mentions_is_a_real_flag_of_dptrain(page: Path, dptrain_flags):
    unknown = sorted({flag for flag in FLAG.findall(TEXT[page]) if flag not in dptrain_flags | set(FOREIGN_FLAGS)})
    assert not unknown, f"{page.relative_to(ROOT)} mentions flags that dptrain does not have: {unknown}"


def test_the_readme_fits_on_two_screens_and_starts_with_make_demo_and_make_test():
    readme = TEXT[ROOT / "README.md"]
    assert len(readme.splitlines()) <= 200
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^docs:", makefile, re.M) and "mkdocs build --strict" in makefile
    for way_in in ("dptrain train", "dptrain run", "dptrain.Trainer"):
        assert way_in in readme
