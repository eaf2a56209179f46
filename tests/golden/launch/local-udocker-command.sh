#!/bin/bash
# Local job: 2 ranks (1 node x 2 tasks), each in udocker container dptrain.
# Every rank runs: python train.py --epochs 3
# Written by dptrain launch; rerun it rather than editing this file (--setup adds set-up lines).
set -euo pipefail
cd /home/ada/project
# CPU threads per rank (no --cpus-per-task): the CPUs the job was given on this node (nproc) shared
# among the ranks on it, at least 1.
threads=$(( $(nproc) / 2 ))
export OMP_NUM_THREADS=$(( threads > 1 ? threads : 1 ))
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
echo "dptrain: $OMP_NUM_THREADS CPU threads per rank (OMP_NUM_THREADS; --cpus-per-task N asks for N)"

# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it
# offline. As root udocker needs --allow-root; a normal user needs nothing.
udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/udocker.conf")
if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi

# Rendezvous on this machine; the port is derived from this script's PID, like a job id.
# The command meets its world as under torchrun: init_process_group("env://") reads MASTER_ADDR,
# MASTER_PORT, WORLD_SIZE and RANK (each rank's own; LOCAL_RANK too).
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000)) WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 DPTRAIN_RUN_DIR=/home/ada/project/runs/mine

# One container per rank
# (each in its own process group, which a signal reaches whole: a program's children too).
start_ranks() {
    pids=()
    for rank in $(seq 0 1); do
        RANK=$rank LOCAL_RANK=$rank bash -c 'trap "" TERM USR1 USR2 INT; exec "$@"' rank "${udocker[@]}" run --nobanner --hostenv -v /etc/hosts -v /home/ada/project -v /scratch/ada/data -w /home/ada/project dptrain python train.py --epochs 3 &
        pids+=($!)
    done
}

# A stop signal (TERM, USR1, USR2) or Ctrl-C (INT) sent to this script reaches every rank; the job then
# ends. (With job control on, `set -m`, the ranks do not ignore INT as background commands otherwise do.)
set -m
pids=() stopping="" trapped=""
for signal in TERM USR1 USR2 INT; do
    trap "stopping=$signal trapped=1; kill -s $signal -- \${pids[*]/#/-} 2>/dev/null || true" "$signal"
done
alive() {
    local pid; for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && return 0; done; return 1
}
# The job's exit code: the first failure's (the others are stopped, as srun --kill-on-bad-exit does), else
# 75 when a rank stopped to be resumed, else 0.
wait_ranks() {
    local left=${#pids[@]} code=0 status pid
    while [ "$left" -gt 0 ] && [ -z "$stopping" ]; do
        trapped="" status=0
        wait -n || status=$?
        if [ -n "$trapped" ] && [ "$status" -gt 128 ]; then continue; fi  # a stop signal, not a rank, ended it
        left=$((left - 1))
        if [ "$status" -eq 75 ]; then
            code=75
        elif [ "$status" -ne 0 ]; then
            kill -- "${pids[@]/#/-}" 2>/dev/null || true
            wait || true
            echo "dptrain: a rank exited with code $status; stopped the others" >&2
            return "$status"
        fi
    done
    if [ -z "$stopping" ]; then return "$code"; fi
    # After a stop signal the ranks have 300 s (--grace) to save and exit; the rest are killed.
    local waited=0 rank
    while [ "$waited" -lt 300 ] && alive; do sleep 1; waited=$((waited + 1)); done
    for rank in "${!pids[@]}"; do
        if kill -0 -- "-${pids[rank]}" 2>/dev/null; then
            echo "dptrain: rank $rank had not exited 300 s (--grace) after SIG$stopping; killing it" >&2
            kill -KILL -- "-${pids[rank]}" 2>/dev/null || true
        fi
    done
    for pid in "${pids[@]}"; do  # how each rank ended after the stop signal (127: counted above)
        while :; do
            trapped="" status=0
            wait "$pid" 2>/dev/null || status=$?
            if [ -z "$trapped" ] || [ "$status" -le 128 ]; then break; fi
        done
        if [ "$status" -eq 75 ]; then code=75; elif [ "$status" -ne 0 ] && [ "$status" -ne 127 ] && [ "$code" -eq 0 ]; then code=$status; fi
    done
    return "$code"
}

# Ranks that stop to be resumed (exit code 75) while this script was sent no stop signal (a rank was
# stopped on its own) start again, resuming from the checkpoint in the run directory, as a SLURM job
# is requeued; at most 10 times (--max-requeues).
requeues=0
while :; do
    start_ranks
    status=0
    wait_ranks || status=$?
    if [ "$status" -eq 75 ] && [ -z "$stopping" ] && [ "$requeues" -lt 10 ]; then
        requeues=$((requeues + 1))
        echo "dptrain: the ranks stopped to be resumed (exit code 75); starting them again from the run directory's checkpoint (requeue $requeues of 10)"
        continue
    fi
    exit "$status"
done
