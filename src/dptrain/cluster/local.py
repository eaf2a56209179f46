"""This machine, no scheduler: a bash script that runs the job now.

Without a container it hands the ranks to dptrain's own launcher (`dptrain train --workers N`).
With one, or for a user's command, the script starts one process (container) per rank itself, with
the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and stops
the others when one fails.

Inside, the ranks dptrain's own launchers started (`dptrain train --workers N`, `dptrain run`) carry
DPTRAIN_LAUNCHER beside torchrun's variables; the ranks the script starts itself carry only torchrun's
(dptrain.cluster.torchrun). There is no job id: the rendezvous is this machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Mapping, Optional

from dptrain.cluster.base import Job, Placement
from dptrain.cluster.containers import rank_command
from dptrain.cluster.spec import JobSpec, header, process_environment, quote, train_command
from dptrain.cluster.submit import JobStatus
from dptrain.cluster.torchrun import torchrun_ranks

SCRIPT_NAME = "job.sh"
SUBMIT_COMMAND = "bash"  # what submits (or, locally, runs) the script
OUTPUT_NAME = "job.out"
# First: a rank dptrain's launcher started (DPTRAIN_LAUNCHER) is that launcher's, whatever launcher
# started dptrain itself (its variables, e.g. mpirun's, pass on to the ranks).
PRIORITY = 0

# Jobs this process started, by job id (the script's PID), so that poll() can read their exit codes.
_started: dict[str, subprocess.Popen] = {}


def render(spec: JobSpec) -> str:
    lines = [*header(spec, "Local job"), "set -euo pipefail", f"cd {quote([spec.workdir])}",
             *process_environment(spec), ""]
    if spec.container is None and not spec.command:
        lines += ["# dptrain's own launcher starts the ranks and stops them all if one fails.",
                  f"exec {quote(train_command(spec))} --workers {spec.world_size}"]
        return "\n".join(lines) + "\n"
    setup, command = rank_command(spec)
    run_dir = f" DPTRAIN_RUN_DIR={quote([spec.run_dir])}" if spec.command else ""
    lines += [
        *([*setup, ""] if setup else []),
        "# Rendezvous on this machine; the port is derived from this script's PID, like a job id.",
        *(["# The command meets its world as under torchrun: init_process_group(\"env://\") reads MASTER_ADDR,",
           "# MASTER_PORT, WORLD_SIZE and RANK (each rank's own; LOCAL_RANK too)."] if spec.command else []),
        f"export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000)) WORLD_SIZE={spec.world_size} "
        f"LOCAL_WORLD_SIZE={spec.world_size}{run_dir}",
        "",
        "# One container per rank." if spec.container else "# One process per rank.",
        "pids=()",
        f"for rank in $(seq 0 {spec.world_size - 1}); do",
        f"    RANK=$rank LOCAL_RANK=$rank {command} &",
        "    pids+=($!)",
        "done",
        "# The first rank to fail stops the others, as srun --kill-on-bad-exit does.",
        'for _ in "${pids[@]}"; do',
        "    wait -n && continue",
        "    status=$?",
        '    kill "${pids[@]}" 2>/dev/null || true',
        "    wait || true",
        '    echo "dptrain: a rank exited with code $status; stopped the others" >&2',
        '    exit "$status"',
        "done",
    ]
    return "\n".join(lines) + "\n"


def output_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / OUTPUT_NAME


def submit(script: Path) -> str:
    """Start the script in its own session, output to job.out beside it; the job id is its PID."""
    with open(script.parent / OUTPUT_NAME, "ab") as output:
        proc = subprocess.Popen([SUBMIT_COMMAND, str(script)], stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _started[str(proc.pid)] = proc
    return str(proc.pid)


def poll(job_id: str) -> JobStatus:
    code = _started[job_id].poll()
    if code is None:
        return JobStatus(state="RUNNING", finished=False)
    return JobStatus(state="COMPLETED" if code == 0 else "FAILED", finished=True,
                     exit_code=code if code >= 0 else 128 - code)


# ---- inside a job ----------------------------------------------------------------------------

def job(env: Mapping[str, str]) -> Optional[Job]:
    """None: a job on this machine has no scheduler's id or node list."""
    return None


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    """The ranks dptrain's own launchers started: torchrun's variables, named by DPTRAIN_LAUNCHER."""
    if "RANK" not in env or "WORLD_SIZE" not in env or not env.get("DPTRAIN_LAUNCHER"):
        return None
    return torchrun_ranks(env, env["DPTRAIN_LAUNCHER"])
