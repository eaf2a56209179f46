"""MkDocs hooks (mkdocs.yml): the pages generated from the code, and the benchmark record with its plots.

- troubleshooting.md: `<!-- troubleshooting-catalogue -->` becomes dptrain.troubleshooting's catalogue,
  which tests/test_troubleshooting.py checks against the messages the code prints.
- reference/api.md: `<!-- api-exports -->` becomes one mkdocstrings block per name dptrain exports
  (dptrain._EXPORTS), so a new export is documented without editing the page.
- benchmarks/record.md is benchmarks/README.md itself, and the PNG plots under benchmarks/results are
  served from where they are: nothing is copied into docs/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's dptrain, not another installed one

import dptrain  # noqa: E402
from dptrain.troubleshooting import render_markdown  # noqa: E402

RECORD = "benchmarks/record.md"
# The members the API page shows of an export, where not all of its public ones: the strategies' hooks
# (after_backward, gather_stats, ...) are for writing a strategy, documented under Strategy itself.
MEMBERS = {"Trainer": ["fit", "evaluate", "history"], "Summary": ["to_dict", "from_dict"], "AllReduce": False,
           "Sync": False, "Streaming": False, "Async": False, "FedAvg": False, "Hierarchical": False, "Auto": False,
           "TrainConfig": False}


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, RECORD, abs_src_path=str(ROOT / "benchmarks" / "README.md")))
    for plot in sorted((ROOT / "benchmarks" / "results").rglob("*.png")):
        files.append(File.generated(config, plot.relative_to(ROOT).as_posix(), abs_src_path=str(plot)))
    return files


def api_blocks() -> str:
    """One `::: module.Name` per export of dptrain, in the order of dptrain._EXPORTS, each under the module
    that defines it (some exports pass through a package's lazy __getattr__, which mkdocstrings cannot follow)."""
    blocks = []
    for name in dptrain._EXPORTS:
        block = f"::: {getattr(dptrain, name).__module__}.{name}"
        if name in MEMBERS:
            block += f"\n    options:\n      members: {json.dumps(MEMBERS[name])}"
        blocks.append(block)
    return "\n\n".join(blocks)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "troubleshooting.md":
        return markdown.replace("<!-- troubleshooting-catalogue -->", render_markdown())
    if page.file.src_uri == "reference/api.md":
        return markdown.replace("<!-- api-exports -->", api_blocks())
    return markdown
