"""A 16-rank world on one machine: every strategy keeps its exact properties (benchmarks/scale.py's checks).

16 real processes (forked from a server that imported torch once: 16 imports of torch would cost
about a minute of CPU on two cores; benchmarks/scale.py starts its worlds with the real spawner),
joined by gloo over a TCP store on 127.0.0.1 with dptrain's heartbeats, train one epoch of
allreduce, sync, async and fedavg in turn in the same process group;
the checks are the benchmark's: every row trained on exactly once, allreduce equal to the replay
of its averaged gradients, sync and async the mean of the replicas, fedavg weighted by the
partitions, the same model on every rank, comm_bytes exact; and one heartbeat thread per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale  # noqa: E402 - the benchmark script, imported as a module
import scale_worker as worker  # noqa: E402

WORLD = 16


def _rank(rank, world):
    return worker.run(worker.join(), list(worker.STRATEGIES))


@pytest.mark.slow
def test_sixteen_ranks_keep_every_strategys_exact_properties():
    records = run_distributed(_rank, WORLD, timeout=240)
    distances = scale.check(records, WORLD)
    assert set(distances) == {"allreduce", "sync", "async", "fedavg"}
    for record in records:
        assert [name for name in record["python_threads"] if name.startswith("dptrain-")] == \
               [f"dptrain-heartbeat-{record['rank']}"]
