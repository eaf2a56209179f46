"""Datasets for data-parallel training: the blocked DSTensor, the table of kinds of data source
(dptrain.data.kinds) and the built-in and file sources.

Names are imported when first used: the config and `dptrain launch` read the table of kinds
without importing numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DSTensor": "dptrain.data.dstensor",
    "DATASET_NAMES": "dptrain.data.sources",
    "Dataset": "dptrain.data.sources",
    "load_dataset": "dptrain.data.sources",
    "DataSplits": "dptrain.data.kinds",
    "Source": "dptrain.data.kinds",
    "check_spec": "dptrain.data.kinds",
    "load_data": "dptrain.data.kinds",
    "register_source": "dptrain.data.kinds",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dptrain.data' has no attribute '{name}'")
    return getattr(importlib.import_module(_WHERE[name]), name)
