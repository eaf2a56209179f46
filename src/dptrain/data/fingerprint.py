"""A training set's fingerprint: its row count and a hash of sampled rows, to tell whether a checkpoint's data changed.

A checkpoint records the fingerprint of the data it was trained on (dptrain.train.checkpoint_files); a run
resumed on other data (a file replaced, rows added, removed or permuted, another held-out split) is refused
instead of training on with rows that moved between training and testing. Reading every row would cost as
much as an epoch on a file larger than memory, so the hash covers SAMPLES rows at fixed, evenly spaced
positions (the first and last among them), each row's bytes with its shape and dtype: a permutation or
any change of the rows' count moves them. A change confined to rows between the samples goes unseen; the
fingerprint guards against the wrong data set, not against tampering.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np

SAMPLES = 64  # rows hashed (all of them when there are fewer)


def sampled_rows(count: int, samples: int = SAMPLES) -> np.ndarray:
    """The positions hashed in a data set of `count` rows: evenly spaced, the first and the last included."""
    if count <= samples:
        return np.arange(count, dtype=np.int64)
    return np.unique(np.linspace(0, count - 1, samples).round().astype(np.int64))


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(value))


def _update(digest, value: Any) -> None:
    array = _as_array(value)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())


def fingerprint(dataset: Any) -> dict:
    """{"rows": the number of rows, "sha256": the hash of the sampled rows (x and y)} of a map-style
    Dataset of (x, y) items (one that reads many rows at once through __getitems__, as dptrain's arrays do,
    is read so)."""
    if getattr(dataset, "is_stream", False):  # shards: their names and sizes (dptrain.data.streams)
        return dataset.fingerprint()
    count = len(dataset)
    rows = sampled_rows(count)
    digest = hashlib.sha256(f"rows={count}".encode())
    if hasattr(dataset, "__getitems__") and len(rows):
        x, y = dataset.__getitems__(rows.tolist())
        for position in range(len(rows)):
            _update(digest, x[position])
            _update(digest, y[position])
    else:
        for row in rows.tolist():
            x, y = dataset[row]
            _update(digest, x)
            _update(digest, y)
    return {"rows": count, "sha256": digest.hexdigest()}


def difference(recorded: Optional[dict], now: dict) -> Optional[str]:
    """What differs between a recorded fingerprint and the data's now, in words, or None when they agree
    (or nothing was recorded: a checkpoint older than fingerprints)."""
    if not recorded:
        return None
    if recorded.get("rows") != now["rows"]:
        return f"{recorded.get('rows'):,} training rows then, {now['rows']:,} now"
    if recorded.get("sha256") != now["sha256"]:
        return f"the same {now['rows']:,} training rows in number, but other rows or in another order"
    return None
