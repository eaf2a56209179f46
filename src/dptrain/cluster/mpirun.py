"""Open MPI's mpirun: the OMPI_COMM_WORLD_* variables it gives each rank, and its job id for the port."""

from __future__ import annotations

from typing import Mapping, Optional

from dptrain.cluster.base import Placement, integer

# After torchrun's variables (a rank that was given RANK keeps it), before MPICH's PMI and srun:
# Open MPI starts its daemons on other nodes with srun, so remote ranks see that step's SLURM_PROCID.
PRIORITY = 20


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return Placement("mpirun", integer(env, "OMPI_COMM_WORLD_RANK"), integer(env, "OMPI_COMM_WORLD_SIZE"),
                 integer(env, "OMPI_COMM_WORLD_LOCAL_RANK"), integer(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))


def launch_id(env: Mapping[str, str]) -> Optional[str]:
    """Open MPI's job id, the same for every rank of one mpirun."""
    return env.get("OMPI_MCA_ess_base_jobid")
