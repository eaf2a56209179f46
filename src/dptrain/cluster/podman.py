"""Podman, rootless: one `podman run` per rank, in the user's own user namespace.

`--userns=keep-id` keeps the user's uid inside, so what the ranks write into the bound run directory is
the user's; host network and IPC let the ranks meet (gloo, NCCL) as on the host. Podman passes no host
variable unless named: the ranks', the schedulers' and MPI's are. GPUs come by CDI
(`--device nvidia.com/gpu=all`, the site's `nvidia-ctk cdi generate`) when the job asks for them.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command

IMAGE = "IMAGE"  # what follows "podman:": an image in the user's storage on every node (podman load -i)
# What a rank reads from its environment; podman passes a NAME without a value (or a NAME* glob) from the host.
PASSED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
          "TORCH_CPP_LOG_LEVEL", "DPTRAIN_*", "SLURM_*", "PBS_*", "OMPI_*", "PMI_*", "PMIX_*", "NCCL_*")


def running_inside(env: Mapping[str, str]) -> bool:
    """Podman sets container=podman in every container."""
    return env.get("container") == "podman"


def preamble(spec: JobSpec) -> list[str]:
    return ["# Podman, rootless: the image is in the user's container storage on every node (podman load -i)."]


def wrap(spec: JobSpec) -> str:
    gpu = ["--device", "nvidia.com/gpu=all"] if spec.gpus_per_node > 0 else []
    env = [word for name in PASSED for word in ("--env", name)]
    volumes = [word for path in bind_paths(spec) for word in ("--volume", path if ":" in path else f"{path}:{path}")]
    return quote(["podman", "run", "--rm", "--userns=keep-id", "--network=host", "--ipc=host", *gpu, *env, *volumes,
                  "--workdir", spec.workdir, spec.container.image, *train_command(spec)])


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail) for: podman installed, the image `name` runs the command."""
    found = shutil.which("podman")
    results = [("podman", found is not None, found or "not on the PATH")]
    if found:
        volumes = [word for path in binds for word in ("--volume", path if ":" in path else f"{path}:{path}")]
        result = subprocess.run([found, "run", "--rm", "--userns=keep-id", *volumes, name, *command],
                                capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        lines = (result.stdout + result.stderr).strip().splitlines() or ["no output"]
        results.append((f"runs {' '.join(command)}", result.returncode == 0, lines[-1]))
    return results
