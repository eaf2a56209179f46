"""Where a job runs: one module per scheduler (slurm, pbs, local, kubernetes), per launcher that is not a scheduler
(torchrun, mpirun, pmi) and per container runtime (udocker, apptainer), each registered once in
dptrain.registry.

A scheduler's module holds both sides of it: the job script (`render(spec) -> str`, pure, tested
against golden files; submitting and following a job is a separate, thin step) and its in-job
environment (`job(env)`: am I inside one of its jobs, which, on which nodes; `ranks(env)`: rank and
world of the processes its own launcher started). A launcher's module holds only the latter, a
container runtime's its rank command and its marker variables. This package sits below
dptrain.runtime, which combines the environments into one DistEnv (dptrain.runtime.env), and below
dptrain.launch, the `dptrain launch` and `dptrain container` commands.
"""
