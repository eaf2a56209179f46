"""`dptrain info`: what the runtime detects here — the first thing to run when a job misbehaves."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path
from typing import Optional

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


def run_report(run_dir: Path) -> dict:
    """A run directory's state: running or not, epochs recorded, the live workers and every membership change."""
    from dptrain.config import RUN_SETTINGS, read_yaml
    from dptrain.errors import UserError
    from dptrain.train.rundir import JOIN_FILE, check_not_busy

    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"'{run_dir}' is not a run directory (it has no config.yaml); give a run's --out")
    config = read_yaml(run_dir / "config.yaml", "run settings file", RUN_SETTINGS)
    try:
        check_not_busy(str(run_dir))
        running = False
    except UserError:
        running = True
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    changes = [{"epoch": record["epoch"], **record["membership"]} for record in records if record.get("membership")]
    members = changes[-1]["members"] if changes else list(range(int(config.get("workers", 1))))
    report = {"run": str(run_dir), "state": "running" if running else
              ("finished" if (run_dir / "summary.json").exists() else "stopped"),
              "strategy": config.get("strategy"),
              "epochs recorded": f"{len(records)} of {config.get('epochs')}",
              "live workers": f"{len(members)} (ranks {', '.join(map(str, members))} of the job)"
              if records else "-"}
    for change in changes:
        what = [f"without {_ranks(change['left'])}"] if change["left"] else []
        what += [f"{_ranks(change['joined'])} joined"] if change.get("joined") else []
        report[f"membership {change['generation']}"] = (f"{'; '.join(what)}: {len(change['members'])} workers from "
                                                       f"epoch {change['continued_from_epoch']}")
    if config.get("min_workers") is not None:
        least = int(config["min_workers"])
        report["elastic"] = (f"goes on down to {least} worker{'s' if least != 1 else ''}"
                             + (", each failed one replaced" if config.get("replace_workers") else "")
                             + (f", grows up to {config['max_workers']} with `dptrain join`"
                                if config.get("max_workers") else "")
                             + (_takes_one(config, members) if running and (run_dir / JOIN_FILE).exists() else ""))
    return report


def _takes_one(config: dict, members: list) -> str:
    """Whether a worker `dptrain join` adds enters at the next epoch end, or waits as a spare for a place."""
    most = int(config.get("max_workers") or config.get("workers", 1))
    if len(members) < most:
        return f"; `dptrain join` adds a worker now ({len(members)} of {most} train)"
    return f"; `dptrain join` waits as a spare now ({most} of {most} train)"


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def info(run_dir: Optional[str] = None) -> int:
    """The runtime's report; with `run_dir`, also that run's state (its live membership among it)."""
    from rich.console import Console
    from rich.table import Table

    reports = [("dptrain runtime", runtime_report())]
    if run_dir is not None:
        reports.append(("dptrain run", run_report(Path(run_dir))))
    for title, report in reports:
        table = Table(title=title, show_header=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        for key, value in report.items():
            table.add_row(key, "-" if value is None else str(value))
        Console().print(table)
    return 0
