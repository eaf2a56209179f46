"""Which files a shard pattern names (--data 'shards/train-{000000..000099}.tar', a glob, a directory of
.parquet files), without importing numpy or torch: the config and `dptrain launch` recognise and check it."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional

from dptrain.errors import UserError


def looks_like_shards(data: Optional[str], base: Path) -> bool:
    """Whether --data names shards: a brace or glob pattern, a .tar or .parquet file, or a directory of .parquet."""
    if data is None:
        return False
    path = base / data
    if any(mark in data for mark in ("{", "*", "?", "[")) and not path.exists():
        return True
    if data.endswith((".tar", ".parquet")):
        return True
    return path.is_dir() and any(path.glob("*.parquet"))


def shard_paths(data: str, base: Path) -> list[str]:
    """The files --data names, sorted; one line when it names none."""
    try:
        import braceexpand  # webdataset's own pattern expansion
    except ImportError:
        raise UserError(f"--data '{data}' names shards, which need the webdataset package: "
                        "pip install 'dptrain[streams]'") from None

    path = base / data
    if path.is_dir():
        found = sorted(str(file) for file in path.glob("*.parquet"))
    else:
        found = sorted({match for each in braceexpand.braceexpand(str(path)) for match in glob.glob(each)})
    if not found:
        raise UserError(f"--data '{data}' matches no files (in {base}); give a pattern of existing shards such as "
                        "'shards/train-{000000..000009}.tar', or a directory of .parquet files")
    kinds = {Path(file).suffix for file in found}
    if len(kinds) > 1 or not kinds <= {".tar", ".parquet"}:
        raise UserError(f"--data '{data}' matches {', '.join(sorted(kinds))} files; shards are all .tar "
                        "(WebDataset) or all .parquet")
    return found
