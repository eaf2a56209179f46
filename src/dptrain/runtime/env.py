"""Who am I? Rank, world size, local rank and rendezvous address from the launcher's environment.

Pure functions of an environment mapping, so each launcher is tested from a synthetic
environment. Two questions are answered separately:

* who started the ranks (`launcher`): dptrain's local launcher, torchrun, srun, mpirun
  (Open MPI), a PMI launcher (MPICH/Intel MPI mpiexec, common under PBS);
* where to meet (`master_addr`, `master_port`): MASTER_ADDR/MASTER_PORT when set, else the
  scheduler's node list (SLURM_JOB_NODELIST, PBS_NODEFILE), else 127.0.0.1 when every rank
  is on this node. The port is derived from the job id so that all ranks agree without talking.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from typing import Mapping, Optional

import hostlist

from dptrain import registry
from dptrain.errors import UserError

DEFAULT_PORT = 29500
# Derived ports stay in [20000, 40000): above most services, below the usual ephemeral range.
PORT_BASE, PORT_SPAN = 20000, 20000
# DPTRAIN_LAUNCHER of the ranks dptrain itself started on this machine: `dptrain train`'s workers
# ("local": the launcher opened the run directory, checked the data and prints the run's last
# line) and the ranks of a user's script under `dptrain run` ("dptrain-run": nothing prepared).
# Both launchers stop every rank on Ctrl-C and say so once, themselves.
OWN_LAUNCHERS = ("local", "dptrain-run")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. `launcher` is 'single' when nothing launched ranks."""

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    scheduler: str = "none"
    job_id: Optional[str] = None
    nodes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def launched(self) -> bool:
        """True when an outside launcher (or ours) started this process as one rank of many."""
        return self.launcher != "single"


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def port_from_job_id(job_id: str) -> int:
    """A port every rank of one job computes alike, differing between concurrent jobs."""
    digits = re.sub(r"\D", "", job_id)
    number = int(digits) if digits else sum(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed task counts per node, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise UserError(f"cannot parse SLURM tasks per node {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _scheduler(env: Mapping[str, str]) -> tuple[str, Optional[str], tuple[str, ...]]:
    """(scheduler name, job id, node names) from SLURM or PBS variables."""
    if "SLURM_JOB_ID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        try:
            nodes = tuple(hostlist.expand_hostlist(nodelist)) if nodelist else ()
        except hostlist.BadHostlist:
            raise UserError(f"cannot parse SLURM node list {nodelist!r}") from None
        return "slurm", env["SLURM_JOB_ID"], nodes
    if "PBS_JOBID" in env:
        nodes: list[str] = []
        nodefile = env.get("PBS_NODEFILE")
        if nodefile and os.path.isfile(nodefile):
            with open(nodefile) as handle:
                for line in handle:
                    name = line.strip()
                    if name and name not in nodes:
                        nodes.append(name)
        return "pbs", env["PBS_JOBID"], tuple(nodes)
    return "none", None, ()


def _ranks(env: Mapping[str, str]) -> Optional[tuple[str, int, int, int, int]]:
    """(launcher, rank, world, local rank, local world) or None when no launcher is present."""
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = env.get("DPTRAIN_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        world = _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else _int(env, "RANK")
        return launcher, _int(env, "RANK"), world, local_rank, local_world
    if "OMPI_COMM_WORLD_RANK" in env:
        return ("mpirun", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    # Before SLURM: MPICH/Intel MPI mpiexec starts one proxy per node with srun, so its ranks
    # inherit the proxy's SLURM_PROCID; PMI_RANK is the real rank.
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        world = _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else 0
        local_world = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else world
        return "pmi", _int(env, "PMI_RANK"), world, local_rank, local_world
    # SLURM_PROCID is also set in the batch script itself; only an srun step has SLURM_STEP_ID.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and env.get("SLURM_STEP_ID") != "batch":
        world = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        tasks_per_node = expand_tasks_per_node(
            env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world))
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        local_world = tasks_per_node[node] if node < len(tasks_per_node) else tasks_per_node[0]
        return "srun", _int(env, "SLURM_PROCID"), world, local_rank, local_world
    return None


def detect(env: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Describe this process from its environment (os.environ by default)."""
    env = os.environ if env is None else env
    scheduler, job_id, nodes = _scheduler(env)
    ranks = _ranks(env)
    if ranks is None:
        return DistEnv(launcher="single", scheduler=scheduler, job_id=job_id, nodes=nodes)
    launcher, rank, world, local_rank, local_world = ranks
    if not 0 <= rank < world:
        raise UserError(f"rank {rank} is outside the world of {world} ranks that the {launcher} environment describes")

    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif local_world >= world:
        addr = "127.0.0.1"
    elif nodes:
        addr = nodes[0]
    else:
        raise UserError(
            f"cannot tell the rendezvous address of this {world}-rank {launcher} job across nodes: "
            "set MASTER_ADDR to the host name of rank 0 (and MASTER_PORT to a free port)")

    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    elif job_id:
        port = port_from_job_id(job_id)
    elif "OMPI_MCA_ess_base_jobid" in env:
        port = port_from_job_id(env["OMPI_MCA_ess_base_jobid"])
    else:
        port = DEFAULT_PORT
    return DistEnv(launcher=launcher, rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=local_world, master_addr=addr, master_port=port,
                   scheduler=scheduler, job_id=job_id, nodes=nodes)


def detect_container(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The registered container runtime whose marker variables are set, or None outside containers.

    Each runtime's backend module knows its own markers (`running_inside`); it is loaded by name
    here, so asking needs neither the job-script package nor every backend at import time.
    """
    env = os.environ if env is None else env
    names = registry.names("container runtime")
    return next((name for name in names if registry.load("container runtime", name).running_inside(env)), None)


def launcher_reports_interrupts(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether dptrain's own launcher started this rank, and so says once that Ctrl-C stopped the ranks."""
    return (os.environ if env is None else env).get("DPTRAIN_LAUNCHER") in OWN_LAUNCHERS


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
