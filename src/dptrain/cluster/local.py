"""This machine, no scheduler: a bash script that runs the job now.

Without a container it hands the ranks to dptrain's own launcher (`dptrain train --workers N`).
With one, or for a user's command, the script starts one process (container) per rank itself, with
the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and stops
the others when one fails.

A stop signal (TERM, USR1, USR2) sent to the script reaches every rank (through dptrain's launcher,
or from the script), and ranks still running --grace seconds later are killed and named; the job then
ends. Ranks that exit with 75 while the script was sent no stop signal (one was stopped on its own)
are started again to resume from the run directory's checkpoint, up to --max-requeues times: SLURM's
requeue on this machine. It is not --max-restarts, which `dptrain train` and `dptrain run` apply after
a failure (never after 75).

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
from dptrain.cluster.spec import (JobSpec, header, ignoring, process_environment, quote, setup_lines,
                                  train_command)
from dptrain.cluster.submit import JobStatus
from dptrain.cluster.torchrun import torchrun_ranks

SCRIPT_NAME = "job.sh"
SUBMIT_COMMAND = "bash"  # what submits (or, locally, runs) the script
OUTPUT_NAME = "job.out"
# First: a rank dptrain's launcher started (DPTRAIN_LAUNCHER) is that launcher's, whatever launcher
# started dptrain itself (its variables, e.g. mpirun's, pass on to the ranks).
PRIORITY = 0

# What the script passes on to the ranks: the stop signals and Ctrl-C.
TRAPPED = ("TERM", "USR1", "USR2", "INT")

# Jobs this process started, by job id (the script's PID), so that poll() can read their exit codes.
_started: dict[str, subprocess.Popen] = {}


def render(spec: JobSpec) -> str:
    own_launcher = spec.container is None and not spec.command
    lines = [*header(spec, "Local job", "--setup adds set-up lines"), "set -euo pipefail", f"cd {quote([spec.workdir])}",
             *process_environment(spec), *setup_lines(spec), ""]
    if own_launcher:
        grace = f" --grace {spec.stop_before}" if spec.stop_before else ""
        start = ["# dptrain's own launcher starts the ranks, stops them all if one fails and passes a stop signal on",
                 *([f"# to them, killing (and naming) those still running {spec.stop_before} s later (--grace)."]
                   if spec.stop_before else ["# to them."]),
                 "start_ranks() {",
                 f"    {quote(train_command(spec))} --workers {spec.world_size}{grace} &",
                 "    pids=($!)",
                 "}"]
    else:
        setup, command = rank_command(spec)
        if spec.container:
            # A signal reaches the rank's whole process group: the container runtime must not die of it; the
            # rank inside handles it.
            command = ignoring(" ".join(TRAPPED)) + command
        run_dir = f" DPTRAIN_RUN_DIR={quote([spec.run_dir])}" if spec.command else ""
        start = [
            *([*setup, ""] if setup else []),
            "# Rendezvous on this machine; the port is derived from this script's PID, like a job id.",
            *(["# The command meets its world as under torchrun: init_process_group(\"env://\") reads MASTER_ADDR,",
               "# MASTER_PORT, WORLD_SIZE and RANK (each rank's own; LOCAL_RANK too)."] if spec.command else []),
            f"export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000)) WORLD_SIZE={spec.world_size} "
            f"LOCAL_WORLD_SIZE={spec.world_size}{run_dir}",
            "",
            "# One container per rank" if spec.container else "# One process per rank",
            "# (each in its own process group, which a signal reaches whole: a program's children too).",
            "start_ranks() {",
            "    pids=()",
            f"    for rank in $(seq 0 {spec.world_size - 1}); do",
            f"        RANK=$rank LOCAL_RANK=$rank {command} &",
            "        pids+=($!)",
            "    done",
            "}"]
    # Signals reach dptrain's launcher (which passes them on to its workers), or each rank's process group.
    group = "" if own_launcher else "/#/-"
    if own_launcher or not spec.stop_before:
        graced = []
    else:
        graced = [
            f"    # After a stop signal the ranks have {spec.stop_before} s (--grace) to save and exit; the rest are killed.",
            "    local waited=0 rank",
            f"    while [ \"$waited\" -lt {spec.stop_before} ] && alive; do sleep 1; waited=$((waited + 1)); done",
            "    for rank in \"${!pids[@]}\"; do",
            "        if kill -0 -- \"-${pids[rank]}\" 2>/dev/null; then",
            f"            echo \"dptrain: rank $rank had not exited {spec.stop_before} s (--grace) after SIG$stopping; killing it\" >&2",
            "            kill -KILL -- \"-${pids[rank]}\" 2>/dev/null || true",
            "        fi",
            "    done"]
    lines += [
        *start,
        "",
        "# A stop signal (TERM, USR1, USR2) or Ctrl-C (INT) sent to this script reaches every rank; the job then",
        "# ends. (With job control on, `set -m`, the ranks do not ignore INT as background commands otherwise do.)",
        "set -m",
        'pids=() stopping="" trapped=""',
        f"for signal in {' '.join(TRAPPED)}; do",
        f'    trap "stopping=$signal trapped=1; kill -s $signal -- \\${{pids[*]{group}}} 2>/dev/null || true" "$signal"',
        "done",
        *(["alive() {",
           '    local pid; for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && return 0; done; return 1',
           "}"] if graced else []),
        "# The job's exit code: the first failure's (the others are stopped, as srun --kill-on-bad-exit does), else",
        "# 75 when a rank stopped to be resumed, else 0.",
        "wait_ranks() {",
        '    local left=${#pids[@]} code=0 status pid',
        '    while [ "$left" -gt 0 ] && [ -z "$stopping" ]; do',
        '        trapped="" status=0',
        "        wait -n || status=$?",
        '        if [ -n "$trapped" ] && [ "$status" -gt 128 ]; then continue; fi  # a stop signal, not a rank, ended it',
        "        left=$((left - 1))",
        '        if [ "$status" -eq 75 ]; then',
        "            code=75",
        '        elif [ "$status" -ne 0 ]; then',
        f'            kill -- "${{pids[@]{group}}}" 2>/dev/null || true',
        "            wait || true",
        '            echo "dptrain: a rank exited with code $status; stopped the others" >&2',
        '            return "$status"',
        "        fi",
        "    done",
        '    if [ -z "$stopping" ]; then return "$code"; fi',
        *graced,
        '    for pid in "${pids[@]}"; do  # how each rank ended after the stop signal (127: counted above)',
        "        while :; do",
        '            trapped="" status=0',
        '            wait "$pid" 2>/dev/null || status=$?',
        '            if [ -z "$trapped" ] || [ "$status" -le 128 ]; then break; fi',
        "        done",
        '        if [ "$status" -eq 75 ]; then code=75; elif [ "$status" -ne 0 ] && [ "$status" -ne 127 ] && [ "$code" -eq 0 ]; then code=$status; fi',
        "    done",
        '    return "$code"',
        "}",
        "",
        "# Ranks that stop to be resumed (exit code 75) while this script was sent no stop signal (a rank was",
        "# stopped on its own) start again, resuming from the checkpoint in the run directory, as a SLURM job",
        f"# is requeued; at most {spec.max_requeues} times (--max-requeues).",
        "requeues=0",
        "while :; do",
        "    start_ranks",
        "    status=0",
        "    wait_ranks || status=$?",
        f'    if [ "$status" -eq 75 ] && [ -z "$stopping" ] && [ "$requeues" -lt {spec.max_requeues} ]; then',
        "        requeues=$((requeues + 1))",
        '        echo "dptrain: the ranks stopped to be resumed (exit code 75); starting them again from the run '
        f'directory\'s checkpoint (requeue $requeues of {spec.max_requeues})"',
        "        continue",
        "    fi",
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
