"""The one rule for holding out a test split of a source that gives none, and the line that says so.

Every source without its own test split (an array file without x_test/y_test, a synthetic data set,
a data factory that returns no test set, an image folder without train/ and test/) holds out
``HOLD_OUT`` of its samples: the first ``round(HOLD_OUT * n)`` of
``np.random.default_rng(seed).permutation(n)``. Built-in digits keeps its own fixed split
(scikit-learn's stratified ``train_test_split`` of the same fraction, dptrain.data.sources).
"""

from __future__ import annotations

import numpy as np

HOLD_OUT = 0.2  # the fraction of a source's samples held out for testing when it gives no test split


def hold_out(n: int, seed: int, fraction: float = HOLD_OUT, *,
             at_least_one: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held-out) positions of n samples, each in the order of the seed's permutation of range(n):
    the first round(fraction * n) of it are held out (at least one with `at_least_one`)."""
    # at_least_one: Datasets and image folders have always held out one sample where rounding gives none;
    # array files and synthetic sets refuse such a split instead (dptrain.data.sources._split).
    count = round(fraction * n)
    if at_least_one:
        count = max(1, count)
    order = np.random.default_rng(seed).permutation(n)
    return order[count:], order[:count]


def holding_out_line(why: str, held: int, total: int, fraction: float = HOLD_OUT, unit: str = "samples") -> str:
    """The line said when a test split is held out: `why` names the source and what it lacks."""
    return (f"dptrain: {why}: holding out {held} of its {total} {unit} ({fraction:.0%}, chosen by the seed) "
            "for testing")
