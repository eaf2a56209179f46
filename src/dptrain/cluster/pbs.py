"""PBS (PBS Pro, OpenPBS, Torque): the qsub script (the host's Open MPI mpirun starts one rank, or one
container, per MPI slot), submission with qsub, the job's state from `qstat -f -x`, and inside a job its
id and its hosts (PBS_NODEFILE).

PBS has no launcher of its own: an MPI's mpirun or mpiexec starts the ranks (dptrain.cluster.mpirun,
dptrain.cluster.pmi).

PBS has no --signal: with --time, the script itself sends --stop-signal (USR1 or USR2) to mpirun
--grace seconds before the walltime, and Open MPI's mpirun passes it on to every rank. (It ends the job
on TERM instead, so TERM is not offered.) A job whose ranks stop to be resumed (exit 75) is requeued by
submitting the same script again, to start once this job has ended (qsub -W depend=afterany), up to
--max-requeues times: `qrerun`, which would keep the job id, needs PBS manager or operator privilege,
and a job array runs its subjobs whatever the last one's exit code. The script appends its output to
pbs.out itself, which PBS's -o would overwrite with each job, and writes the next job's id beside it for
`dptrain launch --wait` to follow.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

from dptrain.cluster.base import Job, Placement
from dptrain.cluster.containers import rank_command
from dptrain.cluster.spec import (STOP_SIGNALS, JobSpec, command_environment, header, ignoring, process_environment,
                                  quote, rank_environment, serve_store, setup_lines)
from dptrain.cluster.submit import JobStatus, run_tool

SCRIPT_NAME = "job.pbs"
SUBMIT_COMMAND = "qsub"  # what submits (or, locally, runs) the script
OUTPUT_NAME = "pbs.out"  # every job's output, appended by the script
OWN_OUTPUT_NAME = "pbs-last.out"  # what PBS itself keeps (-o) of the last job: what came before the script ran
REQUEUED_AS = "pbs-requeued-{job_id}"  # a job that was requeued leaves the id of its successor here
FINAL_STATES = {"F", "C"}  # PBS Pro/OpenPBS: F (finished, needs qstat -x); Torque: C (completed)
PRIORITY = 50  # after SLURM: inside a SLURM job, that job's id and nodes are the ones asked for


def render(spec: JobSpec) -> str:
    # Without --cpus-per-task, one CPU per rank is asked for; the ranks' threads are what the node then offers.
    select = (f"select={spec.nodes}:ncpus={spec.tasks_per_node * (spec.cpus_per_task or 1)}"
              f":mpiprocs={spec.tasks_per_node}")
    if spec.gpus_per_node:
        select += f":ngpus={spec.gpus_per_node}"
    if spec.mem:  # per node, as SLURM's --mem: one chunk of the select is one node
        select += f":mem={memory(spec.mem)}"
    # -V: the job starts with the submitting shell's environment (PATH, PYTHONPATH, VIRTUAL_ENV ...), as
    # sbatch's does, so dptrain and the user's modules are found on the first node.
    directives = [f"-N {spec.job_name}", f"-l {select}", f"-l place=scatter{':excl' if spec.exclusive else ''}", "-V"]
    if spec.time:
        directives.append(f"-l walltime={spec.time}")
    if spec.partition:
        directives.append(f"-q {spec.partition}")
    if spec.account:
        directives.append(f"-A {spec.account}")
    directives += ["-j oe", f"-o {spec.run_dir}/{OWN_OUTPUT_NAME}"]
    setup, command = rank_command(spec)
    forwarded = "MASTER_ADDR PBS_JOBID OMP_NUM_THREADS TORCH_CPP_LOG_LEVEL"
    ignore = spec.stop_signal if warning(spec) else ""
    if spec.command:
        forwarded += " MASTER_PORT WORLD_SIZE LOCAL_WORLD_SIZE DPTRAIN_RUN_DIR"
        # A command's ranks get RANK and LOCAL_RANK from Open MPI's own variables. The warning signal starts
        # ignored, as under SLURM (a program that does not handle it keeps running).
        command = rank_environment("$OMPI_COMM_WORLD_RANK", "$OMPI_COMM_WORLD_LOCAL_RANK", ignore=ignore) + command
    elif ignore and spec.container:
        # mpirun signals each rank's whole process group: the container runtime must not die of it; the
        # rank inside handles it.
        command = ignoring(ignore) + command
    port = "$((20000 + 10#0${PBS_JOBID//[!0-9]/} % 20000))"
    # --replace-workers: a new worker in place of a lost rank runs on this first node of the job, beside the
    # store (PBS counts it among the job's processes there); it shares that node's CPUs with its ranks.
    replace = f"{spec.dptrain} join {quote([spec.run_dir])}"
    elastic = bool(serve_store(spec, port, replace))
    if elastic:
        # --enable-recovery: mpirun keeps the other ranks running when one fails, and then ends with 0
        # whatever its ranks did, so each rank's own exit code is written beside the run (a shell that
        # outlives the rank, and does not die of the stop signals mpirun passes on to its process group).
        forwarded += " MASTER_PORT DPTRAIN_STORE_SERVED DPTRAIN_EXITS DPTRAIN_RUN_SECRET"
        command = (f"bash -c 'trap \"\" {' '.join(STOP_SIGNALS)}; \"$@\"; code=$?; mkdir -p \"$DPTRAIN_EXITS\"; "
                   f"echo \"$code\" > \"$DPTRAIN_EXITS/rank-$OMPI_COMM_WORLD_RANK\"; exit \"$code\"' rank " + command)
    lines = [
        *header(spec, "PBS job", "--pbs-option and --setup add a site's own lines"),
        *(f"#PBS {d}" for d in directives),
        *(f"#PBS {line}" for line in spec.pbs_options),  # the user's, verbatim; after ours, so they win
        "set -euo pipefail",
        f"exec >>{quote([spec.run_dir + '/' + OUTPUT_NAME])} 2>&1  # after the output of the jobs before it",
        f"cd {quote([spec.workdir])}",
        "",
        "# Rendezvous: rank 0 runs on the first host of PBS_NODEFILE; every rank derives the same port",
        "# from PBS_JOBID. mpirun hands both to the ranks on other nodes with -x.",
        'MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")',
        "export MASTER_ADDR",
        *process_environment(spec),
        'echo "dptrain: job $PBS_JOBID on $(sort -u "$PBS_NODEFILE" | paste -sd,), rendezvous $MASTER_ADDR"',
        *setup_lines(spec),
        *command_environment(spec, port),
        *serve_store(spec, port, replace),
        *([f'export DPTRAIN_EXITS={quote([spec.run_dir])}/.exits-"$PBS_JOBID"'] if elastic else []),
        *([""] + setup if setup else []),
        "",
        "# Ranks on other nodes start in their own environment: mpirun hands them these variables, and",
        "# where the program and its modules are found (PATH, PYTHONPATH, the virtualenv) when set.",
        f"forward=({' '.join(f'-x {name}' for name in forwarded.split())})",
        "for name in PATH PYTHONPATH VIRTUAL_ENV LD_LIBRARY_PATH; do",
        '    if [ -n "${!name:-}" ]; then forward+=(-x "$name"); fi',
        "done",
        "",
        *(["# One process per rank, started by the host's Open MPI; --min-workers: when ranks fail, mpirun",
           "# (--enable-recovery) keeps the others running and they go on without them."] if elastic else
          ["# One process per rank (one container each), started by the host's Open MPI."]),
        f'mpirun -np {spec.world_size} --hostfile "$PBS_NODEFILE" --map-by ppr:{spec.tasks_per_node}:node '
        f'--bind-to none {"--enable-recovery " if elastic else ""}"${{forward[@]}}" {command} &',
        "launcher=$!",
        *warning(spec),
        "status=0",
        'wait "$launcher" || status=$?',
        *(['kill "$timer" 2>/dev/null || true'] if warning(spec) else []),
        *(elastic_status(spec) if elastic else []),
        "",
        "# Ranks that saved their state and exited with 75 are resumed by the same script, submitted again to",
        f"# start after this job (qrerun needs PBS operator privilege); at most {spec.max_requeues} times (--max-requeues).",
        'requeues=${DPTRAIN_REQUEUES:-0}',
        f'if [ "$status" -eq 75 ] && [ "$requeues" -lt {spec.max_requeues} ]; then',
        f'    next=$(DPTRAIN_REQUEUES=$((requeues + 1)) qsub -W depend=afterany:"$PBS_JOBID" '
        f'{quote([spec.run_dir + "/" + SCRIPT_NAME])})',
        f'    echo "$next" > {quote([spec.run_dir])}/{REQUEUED_AS.format(job_id="$PBS_JOBID")}',
        f'    echo "dptrain: job $PBS_JOBID stopped to be resumed (exit code 75); requeued as job $next '
        f'(requeue $((requeues + 1)) of {spec.max_requeues})"',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def memory(amount: str) -> str:
    """SLURM's --mem amount (16G; M when no unit) in PBS's units (16gb)."""
    number, unit = (amount[:-1], amount[-1]) if amount[-1] in "KMGT" else (amount, "M")
    return f"{number}{unit.lower()}b"


def elastic_status(spec: JobSpec) -> list[str]:
    """Script lines that set the job's status from its ranks' own exit codes (mpirun --enable-recovery ends
    with 0 whatever they did): 0 when the ranks left finished the run (summary.json), else 75 when a rank
    stopped to be resumed, else the first failure's code."""
    summary = quote([spec.run_dir + "/summary.json"])
    return ['codes=$(cat "$DPTRAIN_EXITS"/rank-* 2>/dev/null || true)',
            'rm -rf "$DPTRAIN_EXITS"',
            f"if [ -f {summary} ]; then",
            '    if [ -n "$codes" ] && grep -qvx 0 <<< "$codes"; then',
            '        echo "dptrain: the ranks left finished the run without the ranks that failed (exit codes" $codes")"',
            "    fi",
            "    status=0",
            'elif grep -qx 75 <<< "$codes"; then',
            "    status=75",
            'elif failed=$(grep -vx 0 <<< "$codes" | head -n 1) && [ -n "$failed" ]; then',
            '    status=$failed',
            "fi"]


def warning(spec: JobSpec) -> list[str]:
    """Script lines that send --stop-signal to mpirun --grace seconds before --time runs out (none without
    both); the timer's pid is $timer."""
    if not spec.time or not spec.stop_before:
        return []
    days, _, clock = spec.time.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    limit = int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds
    after = max(limit - spec.stop_before, 0)
    return [f"# SIG{spec.stop_signal} {spec.stop_before} s before the walltime (PBS has no --signal): mpirun passes it on to",
            "# every rank, which saves a checkpoint and exits with 75.",
            f"(sleep {after} </dev/null >/dev/null 2>&1; echo \"dptrain: job $PBS_JOBID is {spec.stop_before} s from its "
            f"walltime; sending SIG{spec.stop_signal} to the ranks\"; kill -s {spec.stop_signal} \"$launcher\") &",
            "timer=$!"]


def output_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / OUTPUT_NAME


def requeued_as(run_dir: Path, job_id: str) -> Optional[str]:
    """The id of the job that `job_id` requeued itself as (its script submitted it again), or None."""
    path = run_dir / REQUEUED_AS.format(job_id=job_id)
    return path.read_text().strip() or None if path.is_file() else None


def parse_job_id(qsub_output: str) -> str:
    """qsub prints the job id, e.g. `1234.pbs-server`."""
    return qsub_output.strip().splitlines()[-1].strip()


def parse_status(qstat_output: str) -> JobStatus:
    """job_state and Exit_status from `qstat -f -x ID` (PBS Pro) or `qstat -f ID` (Torque)."""
    state = re.search(r"^\s*job_state\s*=\s*(\S+)", qstat_output, re.MULTILINE)
    if not state:
        raise ValueError(f"no job_state in qstat output: {qstat_output[:200]!r}")
    exit_match = re.search(r"^\s*exit_status\s*=\s*(-?\d+)", qstat_output, re.MULTILINE | re.IGNORECASE)
    finished = state.group(1) in FINAL_STATES
    code = int(exit_match.group(1)) if exit_match else (1 if finished else 0)
    # PBS reports a job killed by signal N as 256 + N; negative values are PBS's own failures.
    if code >= 256:
        code = 128 + code - 256
    elif code < 0:
        code = 1
    return JobStatus(state=state.group(1), finished=finished, exit_code=code)


def submit(script: Path) -> str:
    return parse_job_id(run_tool([SUBMIT_COMMAND, str(script)], what="submit the job", cwd=script.parent))


def poll(job_id: str) -> JobStatus:
    return parse_status(run_tool(["qstat", "-f", "-x", job_id], what=f"ask for the state of job {job_id}"))


# ---- inside a job ----------------------------------------------------------------------------

def job(env: Mapping[str, str]) -> Optional[Job]:
    """PBS_JOBID, and the distinct hosts of PBS_NODEFILE (one line per slot) in their order."""
    if "PBS_JOBID" not in env:
        return None
    nodes: list[str] = []
    nodefile = env.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as handle:
            for line in handle:
                name = line.strip()
                if name and name not in nodes:
                    nodes.append(name)
    return Job("pbs", env["PBS_JOBID"], tuple(nodes))


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    """None: PBS starts no ranks itself, the MPI launcher in the job script does."""
    return None
