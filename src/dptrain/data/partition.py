"""Fixed partitions of a data set over clients, for federated training: iid, contiguous, Dirichlet.

Pure functions of (sample count or labels, clients, seed). Every partitioner returns one
sorted index array per client; together they hold every sample exactly once.
"""

from __future__ import annotations

import numpy as np

from dptrain.errors import UserError

PARTITIONERS = ("iid", "contiguous", "dirichlet")
MAX_DIRICHLET_DRAWS = 100


def contiguous(n_samples: int, clients: int) -> list[np.ndarray]:
    """Client k gets samples [k*n//clients, (k+1)*n//clients): file order, sizes within one."""
    bounds = [k * n_samples // clients for k in range(clients + 1)]
    return [np.arange(bounds[k], bounds[k + 1]) for k in range(clients)]


def iid(n_samples: int, clients: int, seed: int) -> list[np.ndarray]:
    """A random equal split: each client's samples are a uniform random subset."""
    permutation = np.random.default_rng(seed).permutation(n_samples)
    return [np.sort(permutation[part]) for part in contiguous(n_samples, clients)]


def dirichlet(labels: np.ndarray, clients: int, alpha: float, seed: int, min_size: int = 1) -> list[np.ndarray]:
    """Label skew: for each class, the shares of the clients are drawn from Dirichlet(alpha).

    Small alpha gives each client few classes; large alpha approaches an iid split. Draws
    are repeated (reproducibly) until every client has at least `min_size` samples.
    """
    if alpha <= 0:
        raise UserError(f"--alpha {alpha} must be positive (small values, e.g. 0.1, give strong label skew)")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise UserError("the dirichlet partition needs integer class labels; use --partition iid or contiguous")
    rng = np.random.default_rng(seed)
    members_by_class = [np.flatnonzero(labels == cls) for cls in np.unique(labels)]
    for _ in range(MAX_DIRICHLET_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for in_class in members_by_class:
            members = rng.permutation(in_class)
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in result) >= min_size:
            return result
    raise UserError(f"--alpha {alpha} leaves some of the {clients} clients with fewer than {min_size} samples "
                    f"in {MAX_DIRICHLET_DRAWS} draws; use a larger --alpha or fewer workers")


def partition(kind: str, labels: np.ndarray, clients: int, *, seed: int, alpha: float = 0.5,
              min_size: int = 1) -> list[np.ndarray]:
    """The partition `kind` of len(labels) samples over `clients` clients."""
    n_samples = len(labels)
    if n_samples < clients * min_size:
        raise UserError(f"{n_samples} samples cannot give each of {clients} clients {min_size} samples")
    if kind == "contiguous":
        return contiguous(n_samples, clients)
    if kind == "iid":
        return iid(n_samples, clients, seed)
    if kind == "dirichlet":
        return dirichlet(labels, clients, alpha, seed, min_size)
    raise UserError(f"unknown partition {kind!r}; valid: {', '.join(PARTITIONERS)}")
