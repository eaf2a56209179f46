"""Job scripts per scheduler (slurm, pbs, local) and rank commands per container runtime (udocker, apptainer).

Rendering is pure (`render(spec) -> str`, tested against golden files); submitting and
following a job is a separate, thin step in each scheduler module.
"""

from dptrain.launch.spec import ContainerSpec, JobSpec

__all__ = ["ContainerSpec", "JobSpec"]
