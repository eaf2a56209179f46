"""--stage-to DIR on several nodes: summary.json lists every node's copy under data.staging.nodes (gathered from
the first process of each node), with their totals beside them.

Two "nodes" are two `dptrain train --nnodes 2 --node-rank I --master 127.0.0.1:PORT` commands on this machine, each
in its own folder with its own shards and its own `local` staging folder, as two machines would have them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from cli_runner import run_dptrain
from stream_data import write_tars

from dptrain.data.staging import every_node
from dptrain.runtime.env import free_port

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_", "SLURM_", "OMPI_", "PMI_",
                                                                     "TORCHELASTIC", "GLOO_", "NCCL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def test_each_nodes_copy_is_in_the_summary(tmp_path):
    nodes = [tmp_path / f"node{k}" for k in (0, 1)]
    for node in nodes:
        write_tars(node / "shards")
    total = sum(path.stat().st_size for path in (nodes[0] / "shards").iterdir())
    master = f"127.0.0.1:{free_port()}"

    def argv(rank: int) -> list[str]:
        return ["train", "--data", "shards/train-{000000..000006}.tar", "--model", "mlp", "--epochs", "2",
                "--batch-size", "8", "--workers", "1", "--nnodes", "2", "--node-rank", str(rank), "--master", master,
                "--stage-to", "local", "--device", "cpu", "--no-progress", "--out", "run"]

    second = subprocess.Popen([sys.executable, "-m", "dptrain", *argv(1)], cwd=nodes[1], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = run_dptrain(argv(0), cwd=nodes[0], env=_env(), timeout=180)
        said = second.communicate(timeout=60)[0]
    finally:
        second.kill()
    assert first.returncode == 0, first.stdout + first.stderr
    assert second.returncode == 0, said
    for output in (first.stdout, said):  # each node's first process copied its node's shards
        assert output.count(f"--stage-to local: copied 7 shards ({total:,} bytes) in ") == 1, output
    for node in nodes:
        assert sorted(p.name for p in (node / "local").iterdir()) == \
            [".dptrain-stage.lock", *(f"train-{k:06d}.tar" for k in range(7))]

    staging = json.loads((nodes[0] / "run" / "summary.json").read_text())["data"]["staging"]
    figures = {"copied": 7, "bytes": total, "already_there": 0, "finished": True}
    assert [{key: node[key] for key in ("host", "folder", *figures)} for node in staging["nodes"]] == \
        [{"host": socket.gethostname(), "folder": os.path.realpath(node / "local"), **figures} for node in nodes]
    assert all(node["seconds"] > 0 for node in staging["nodes"])
    assert {key: staging[key] for key in ("folder", *figures)} == \
        {"folder": "local", "copied": 14, "bytes": 2 * total, "already_there": 0, "finished": True}
    assert staging["seconds"] == max(node["seconds"] for node in staging["nodes"])


class _Gathered:
    """A group whose gather returns the given values (every rank's), as Group.gather_objects does."""

    def __init__(self, values: list) -> None:
        self.values = values

    def gather_objects(self, what: str, value) -> list:
        assert value == self.values[0]  # this rank's own value is the first gathered (rank 0)
        return self.values


def _figures(host: str, copied: int, there: int, seconds: float, finished: bool = True) -> dict:
    return {"host": host, "folder": "/local", "copied": copied, "bytes": 100 * copied, "already_there": there,
            "seconds": seconds, "finished": finished}


def test_the_copiers_of_one_node_make_one_entry_and_the_others_send_nothing():
    # node a: two copiers (a launcher that sets no LOCAL_RANK): one copied all 7, the other waited for DIR's lock
    # and found them there; node b: its copier, cut short by the run's end, and a rank that does not copy; a peer
    # that sends something else is left out
    values = [_figures("a", 7, 0, 1.0), _figures("a", 0, 7, 1.5), None, _figures("b", 3, 2, 0.5, finished=False),
              {**_figures("c", 1, 0, 0.1), "copied": "1"}, ["c"]]
    record = {**values[0], "folder": "local", "path": "/local", "copier": True}
    staging = every_node(_Gathered(values), record)
    assert staging == {"folder": "local", "copied": 10, "bytes": 1000, "already_there": 2, "seconds": 1.5,
                       "finished": False,
                       "nodes": [_figures("a", 7, 0, 1.5), _figures("b", 3, 2, 0.5, finished=False)]}
    one = every_node(_Gathered([values[0]]), record)  # one node: its totals are its own figures
    assert {key: one[key] for key in ("copied", "bytes", "already_there", "seconds", "finished")} == \
        {key: values[0][key] for key in ("copied", "bytes", "already_there", "seconds", "finished")}
    assert one["nodes"] == [values[0]]
