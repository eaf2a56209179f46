"""Who am I? Rank, world size, local rank and rendezvous address from the launcher's environment.

Pure functions of an environment mapping, so each launcher is tested from a synthetic
environment. What each scheduler and launcher sets is known by its own module in dptrain.cluster
(registered in dptrain.registry); this module asks them all and combines the answers. Two
questions are answered separately:

* who started the ranks (`launcher`): the first registered environment, by PRIORITY, whose
  `ranks` recognises the variables: dptrain's local launcher, torchrun, mpirun (Open MPI), a PMI
  launcher (MPICH/Intel MPI mpiexec, common under PBS), srun;
* where to meet (`master_addr`, `master_port`): MASTER_ADDR/MASTER_PORT when set, else the
  scheduler job's first node (SLURM_JOB_NODELIST, PBS_NODEFILE, ...), else 127.0.0.1 when every
  rank is on this node. The port is derived from the job id so that all ranks agree without talking.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Iterable, Mapping, Optional, TypeVar

from dptrain import registry
from dptrain.cluster.base import Job, Placement, integer
from dptrain.errors import UserError

T = TypeVar("T")

DEFAULT_PORT = 29500
# Derived ports stay in [20000, 40000): above most services, below the usual ephemeral range.
PORT_BASE, PORT_SPAN = 20000, 20000
# DPTRAIN_LAUNCHER of the ranks dptrain itself started on this machine: `dptrain train`'s workers
# ("local": the launcher opened the run directory, checked the data and prints the run's last
# line) and the ranks of a user's script under `dptrain run` ("dptrain-run": nothing prepared), and one
# machine's ranks of a job over several without a scheduler ("nodes", dptrain.runtime.nodes: rank 0 opens
# the run directory, as under torchrun). Each launcher stops its ranks on Ctrl-C and says so once, itself.
OWN_LAUNCHERS = ("local", "dptrain-run", "nodes")
# What dptrain.cluster.torchrun calls ranks that only RANK and WORLD_SIZE describe.
GENERIC_LAUNCHER = "env"


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


def port_from_job_id(job_id: str) -> int:
    """A port every rank of one job computes alike, differing between concurrent jobs."""
    digits = re.sub(r"\D", "", job_id)
    number = int(digits) if digits else sum(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def environments() -> list[ModuleType]:
    """Every registered scheduler and launcher module, in the order they are asked: by PRIORITY, then
    registry order (dptrain.cluster.base: Scheduler, Environment)."""
    modules = [registry.load(kind, name) for kind in ("scheduler", "launcher") for name in registry.names(kind)]
    return sorted(modules, key=lambda module: module.PRIORITY)


def _first(answers: Iterable[Optional[T]]) -> Optional[T]:
    """The first answer that is not None (the later ones are not asked), or None."""
    return next((answer for answer in answers if answer is not None), None)


def _port(env: Mapping[str, str], job_id: Optional[str], modules: list[ModuleType]) -> int:
    """MASTER_PORT, else one derived from the scheduler's job id or a launcher's id of this launch."""
    if "MASTER_PORT" in env:
        return integer(env, "MASTER_PORT")
    if job_id:
        return port_from_job_id(job_id)
    launch_id = _first(module.launch_id(env) for module in modules if hasattr(module, "launch_id"))
    return port_from_job_id(launch_id) if launch_id is not None else DEFAULT_PORT


def detect(env: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Describe this process from its environment (os.environ by default)."""
    env = os.environ if env is None else env
    modules = environments()
    job: Optional[Job] = _first(module.job(env) for module in modules if hasattr(module, "job"))
    scheduler, job_id, nodes = (job.scheduler, job.job_id, job.nodes) if job else ("none", None, ())
    answers = ((at, module.ranks(env)) for at, module in enumerate(modules))
    found: tuple[int, Optional[Placement]] = next(((at, answer) for at, answer in answers if answer is not None),
                                                  (len(modules), None))
    at, place = found
    if place is not None and place.launcher == GENERIC_LAUNCHER:
        # RANK exported by a job script over a launcher's own variables (srun's, mpirun's): the rank given
        # is kept, and the launcher recorded is the one underneath that started the process.
        below = _first(module.ranks(env) for module in modules[at + 1:])
        if below is not None:
            place = replace(place, launcher=below.launcher)
    if place is None:
        return DistEnv(launcher="single", scheduler=scheduler, job_id=job_id, nodes=nodes)
    launcher, rank, world = place.launcher, place.rank, place.world_size
    # A worker joining a running job (DPTRAIN_JOIN) takes a rank after the job's first WORLD_SIZE ones.
    if not 0 <= rank < world and not (os.environ.get("DPTRAIN_JOIN") and rank >= world):
        raise UserError(f"rank {rank} is outside the world of {world} ranks that the {launcher} environment describes")

    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif place.local_world_size >= world:
        addr = "127.0.0.1"
    elif nodes:
        addr = nodes[0]
    else:
        raise UserError(
            f"cannot tell the rendezvous address of this {world}-rank {launcher} job across nodes: "
            "set MASTER_ADDR to the host name of rank 0 (and MASTER_PORT to a free port)")

    return DistEnv(launcher=launcher, rank=rank, world_size=world, local_rank=place.local_rank,
                   local_world_size=place.local_world_size, master_addr=addr, master_port=_port(env, job_id, modules),
                   scheduler=scheduler, job_id=job_id, nodes=nodes)


def detect_container(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The registered container runtime whose marker variables are set, or None outside containers.

    Each runtime's module (dptrain.cluster) knows its own markers (`running_inside`); it is loaded
    by name here, so importing this module loads no backend.
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
