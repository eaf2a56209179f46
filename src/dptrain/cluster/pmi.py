"""A PMI launcher: MPICH's or Intel MPI's mpiexec (Hydra), common under PBS; PMI_RANK of PMI_SIZE."""

from __future__ import annotations

from typing import Mapping, Optional

from dptrain.cluster.base import Placement, integer

# Before SLURM: MPICH/Intel MPI mpiexec starts one proxy per node with srun, so its ranks inherit
# the proxy's SLURM_PROCID; PMI_RANK is the real rank.
PRIORITY = 30


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    world = integer(env, "PMI_SIZE")
    local_rank = integer(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else 0
    local_world = integer(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else world
    return Placement("pmi", integer(env, "PMI_RANK"), world, local_rank, local_world)
