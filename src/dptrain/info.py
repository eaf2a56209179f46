"""`dptrain info`: what the runtime detects here — the first thing to run when a job misbehaves."""

from __future__ import annotations

import os
import platform
import socket

import torch
import torch.distributed as dist

from dptrain import __version__
from dptrain.runtime.env import detect, detect_container


def runtime_report() -> dict:
    env = detect()
    cuda = torch.cuda.is_available()
    return {
        "dptrain": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "launcher": env.launcher,
        "scheduler": env.scheduler,
        "job_id": env.job_id,
        "nodes": ",".join(env.nodes) or None,
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "rendezvous": f"{env.master_addr}:{env.master_port}" if env.launched else None,
        "container": detect_container(),
        "backend": "nccl" if cuda and dist.is_nccl_available() else "gloo",
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def info() -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dptrain runtime", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in runtime_report().items():
        table.add_row(key, "-" if value is None else str(value))
    Console().print(table)
    return 0
