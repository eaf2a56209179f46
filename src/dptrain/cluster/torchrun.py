"""torchrun, and any launcher that sets its variables: RANK and WORLD_SIZE (with LOCAL_RANK and
LOCAL_WORLD_SIZE), which init_process_group("env://") reads beside MASTER_ADDR and MASTER_PORT.

torchrun itself is told apart by TORCHELASTIC_RUN_ID; a launcher that sets only the variables
(a job script that exports them, a user's wrapper) is the generic "env" launcher.
"""

from __future__ import annotations

from typing import Mapping, Optional

from dptrain.cluster.base import Placement, integer

# Before the MPI launchers and srun: `srun torchrun ...` or a job script that exports RANK per task
# starts processes that also see SLURM's or MPI's variables, but RANK is the rank they were given.
PRIORITY = 10


def torchrun_ranks(env: Mapping[str, str], launcher: str) -> Placement:
    """The ranks that torchrun's variables describe; without LOCAL_* every rank is on this node."""
    world = integer(env, "WORLD_SIZE")
    local_world = integer(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    local_rank = integer(env, "LOCAL_RANK") if "LOCAL_RANK" in env else integer(env, "RANK")
    return Placement(launcher, integer(env, "RANK"), world, local_rank, local_world)


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return torchrun_ranks(env, "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
