"""SLURM: the sbatch script (srun starts one rank, or one container, per task), submission with sbatch,
the job's state from `scontrol show job` (which needs no accounting database), and inside a job its id,
its nodes (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) and the ranks of an srun step.

A rank that stops to be resumed exits with 75; the script then requeues the job (`scontrol requeue`,
allowed by --requeue) and the requeued job resumes from the checkpoint in the same run directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Optional

import hostlist

from dptrain.cluster.base import Job, Placement, integer
from dptrain.cluster.containers import rank_command, step_options
from dptrain.cluster.spec import (STOP_SIGNALS, JobSpec, command_environment, header, process_environment, quote,
                                  rank_environment, serve_store, setup_lines)
from dptrain.cluster.submit import JobStatus, run_tool
from dptrain.errors import UserError

SCRIPT_NAME = "job.slurm"
SUBMIT_COMMAND = "sbatch"  # what submits (or, locally, runs) the script
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}
# After the launchers that run inside an allocation (torchrun, mpirun, MPICH's mpiexec): they start their
# workers or proxies with srun, so those inherit an srun step's SLURM_PROCID that is not their rank.
PRIORITY = 40


def render(spec: JobSpec) -> str:
    directives = [f"--job-name={spec.job_name}", f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.tasks_per_node}",
                  *cpus_per_task(spec)]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    for flag, value in (("time", spec.time), ("partition", spec.partition), ("account", spec.account),
                        ("mem", spec.mem), ("qos", spec.qos), ("constraint", spec.constraint)):
        if value:
            directives.append(f"--{flag}={value}")
    if spec.exclusive:
        directives.append("--exclusive")
    directives.append(f"--output={spec.run_dir}/slurm-%j.out")
    # A requeued job appends to its output rather than starting it again.
    directives += ["--open-mode=append", "--requeue"]
    if spec.stop_before:
        directives.append(f"--signal={spec.stop_signal}@{spec.stop_before}")
    setup, command = rank_command(spec)
    if spec.command:
        # A command's ranks get RANK and LOCAL_RANK from srun's own variables. The warning signal starts
        # ignored (a program that does not handle it keeps running; one that wants it installs a handler).
        command = rank_environment("$SLURM_PROCID", "$SLURM_LOCALID", ignore=spec.stop_signal if spec.stop_before else "") \
            + command
    else:
        # A signal to the step reaches every process of it, the container runtime's too (udocker's Python,
        # PRoot), which must not die of any stop signal: the rank inside handles them all. TERM comes
        # without a warning as well: the first rank to exit with 75 makes srun (--kill-on-bad-exit)
        # terminate the step, so a runtime dying of TERM would turn a later rank's 75 into 143 (128 +
        # SIGTERM) and the job would fail instead of being requeued. What does not end is killed
        # KillWait seconds later. The rank itself starts with them ignored too: one that comes while its
        # interpreter starts, before dptrain installs its handlers, is lost instead of fatal (138).
        command = f"bash -c 'trap \"\" {' '.join(STOP_SIGNALS)}; exec \"$@\"' rank " + command
    if spec.command:
        stopping = ([f"# SIG{spec.stop_signal} reaches every rank before the time limit (or at a pre-emption warning); it starts",
                     "# ignored, so a program that installs no handler for it runs on. Ranks that save their state",
                     "# and exit with 75, as dptrain train's do, have the job requeued to resume from it."]
                    if spec.stop_before else
                    ["# Ranks that were asked to stop (SIGTERM), save their state and exit with 75, as dptrain",
                     "# train's do, have the job requeued to resume from it."])
        stopped = "stopped to be resumed (its ranks exited with 75); requeueing it"
    elif spec.stop_before:
        stopping = [f"# SIG{spec.stop_signal} before the time limit (or a pre-emption warning) makes every rank save a checkpoint",
                    "# after its current epoch and exit with 75; the job then requeues itself and resumes from it."]
        stopped = "stopped at a checkpoint; requeueing it to resume"
    else:
        stopping = ["# A rank that was asked to stop (SIGTERM, SIGUSR1, SIGUSR2) saves a checkpoint and exits with 75; the job",
                    "# then requeues itself and resumes from it."]
        stopped = "stopped at a checkpoint; requeueing it to resume"
    lines = [
        *header(spec, "SLURM job", "--sbatch-option and --setup add a site's own lines"),
        *(f"#SBATCH {quote([d])}" for d in directives),
        *(f"#SBATCH {line}" for line in spec.sbatch_options),  # the user's, verbatim; after ours, so they win
        "set -euo pipefail",
        f"cd {quote([spec.workdir])}",
        "",
        "# Rendezvous: rank 0 runs on the first node of the allocation, reached at the address SLURM",
        "# itself uses for that node; every rank derives the same port from SLURM_JOB_ID.",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(scontrol show node \"$first_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        'export MASTER_ADDR="${MASTER_ADDR:-$first_node}"',
        *process_environment(spec, cpus_variable="SLURM_CPUS_PER_TASK", node_cpus_variable="SLURM_CPUS_ON_NODE",
                             tasks_variable="SLURM_NTASKS_PER_NODE"),
        'echo "dptrain: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR"',
        *setup_lines(spec),
        *command_environment(spec, "$((20000 + SLURM_JOB_ID % 20000))"),
        *serve_store(spec, "$((20000 + SLURM_JOB_ID % 20000))", replace_step(spec)),
        *([""] + setup if setup else []),
        "",
        *(["# One process per rank (one container each). --min-workers: when ranks fail, srun keeps the others",
            "# running and they go on without them" + (" (rank 0, which serves the store in a container, must stay)."
                                                       if spec.container is not None else ".")]
          if spec.elastic else ["# One process per rank (one container each); if one fails, srun stops the others."]),
        *stopping,
        "status=0",
        f"srun --kill-on-bad-exit={0 if spec.elastic else 1} --nodes={spec.nodes} --ntasks-per-node={spec.tasks_per_node} "
        f"{''.join(option + ' ' for option in cpus_per_task(spec))}{step_options(spec)}{command} || status=$?",
        *([f'if [ "$status" -ne 0 ] && [ -f {quote([str(Path(spec.run_dir) / "summary.json")])} ]; then',
           '    echo "dptrain: the ranks left finished the run without the ranks that failed (srun exit $status)"',
           "    status=0",
           "fi"] if spec.elastic else []),
        'if [ "$status" -eq 75 ]; then',
        f'    echo "dptrain: job $SLURM_JOB_ID {stopped}"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def replace_step(spec: JobSpec) -> str:
    """The job step that starts one new worker in place of a lost rank (--replace-workers): one task on a node
    of the allocation, sharing the CPUs of the ranks' step (--overlap: SLURM keeps a step's resources until
    all of its tasks end, the lost rank's too)."""
    return (f"srun --overlap --nodes=1 --ntasks=1 {''.join(option + ' ' for option in cpus_per_task(spec))}"
            f"--kill-on-bad-exit=1 {spec.dptrain} join {quote([spec.run_dir])}")


def cpus_per_task(spec: JobSpec) -> list[str]:
    """--cpus-per-task=N when given; none otherwise, so that SLURM (and the script's OMP_NUM_THREADS) uses
    what the node offers rather than one core per rank."""
    return [f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task is not None else []


def output_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / f"slurm-{job_id}.out"


def parse_job_id(sbatch_output: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;CLUSTER`."""
    return sbatch_output.strip().splitlines()[-1].split(";")[0].strip()


def parse_status(scontrol_output: str) -> JobStatus:
    """JobState, ExitCode (`CODE:SIGNAL`) and Restarts from `scontrol show job -o ID`."""
    state = re.search(r"\bJobState=(\S+)", scontrol_output)
    if not state:
        raise ValueError(f"no JobState in scontrol output: {scontrol_output[:200]!r}")
    exit_match = re.search(r"\bExitCode=(\d+):(\d+)", scontrol_output)
    code, signal = (int(exit_match.group(1)), int(exit_match.group(2))) if exit_match else (0, 0)
    finished = state.group(1) in FINAL_STATES
    if finished and code == 0:
        code = 128 + signal if signal else (0 if state.group(1) == "COMPLETED" else 1)
    restarts = re.search(r"\bRestarts=(\d+)", scontrol_output)
    return JobStatus(state=state.group(1), finished=finished, exit_code=code,
                     restarts=int(restarts.group(1)) if restarts else 0)


def submit(script: Path) -> str:
    out = run_tool([SUBMIT_COMMAND, "--parsable", str(script)], what="submit the job", cwd=script.parent)
    return parse_job_id(out)


def poll(job_id: str) -> JobStatus:
    return parse_status(run_tool(["scontrol", "show", "job", "-o", job_id], what=f"ask for the state of job {job_id}"))


# ---- inside a job ----------------------------------------------------------------------------

def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed task counts per node, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise UserError(f"cannot parse SLURM tasks per node {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def job(env: Mapping[str, str]) -> Optional[Job]:
    """SLURM_JOB_ID, and the step's nodes (or the allocation's) expanded from SLURM's host list."""
    if "SLURM_JOB_ID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    try:
        nodes = tuple(hostlist.expand_hostlist(nodelist)) if nodelist else ()
    except hostlist.BadHostlist:
        raise UserError(f"cannot parse SLURM node list {nodelist!r}") from None
    return Job("slurm", env["SLURM_JOB_ID"], nodes)


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    """The task of an srun step: SLURM_PROCID of SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)."""
    # SLURM_PROCID is also set in the batch script itself; only an srun step has SLURM_STEP_ID.
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env or env.get("SLURM_STEP_ID") == "batch":
        return None
    world = integer(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else integer(env, "SLURM_NTASKS")
    local_rank = integer(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    tasks_per_node = expand_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world))
    node = integer(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_world = tasks_per_node[node] if node < len(tasks_per_node) else tasks_per_node[0]
    return Placement("srun", integer(env, "SLURM_PROCID"), world, local_rank, local_world)
