#!/bin/bash
# Local job: 2 ranks (1 node x 2 tasks), each in apptainer container /home/ada/images/dptrain.sif.
# Written by dptrain launch; rerun it rather than editing this file.
set -euo pipefail
cd /home/ada/project
export OMP_NUM_THREADS=1
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"

# Apptainer: older sites call it singularity.
apptainer=$(command -v apptainer || command -v singularity)

# Rendezvous on this machine; the port is derived from this script's PID, like a job id.
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000)) WORLD_SIZE=2 LOCAL_WORLD_SIZE=2

# One container per rank.
pids=()
for rank in $(seq 0 1); do
    RANK=$rank LOCAL_RANK=$rank "$apptainer" exec --bind /home/ada/project,/scratch/ada/data --pwd /home/ada/project /home/ada/images/dptrain.sif dptrain train --dataset digits --strategy sync --epochs 10 --out /home/ada/project/runs/digits-sync &
    pids+=($!)
done
# The first rank to fail stops the others, as srun --kill-on-bad-exit does.
for _ in "${pids[@]}"; do
    wait -n && continue
    status=$?
    kill "${pids[@]}" 2>/dev/null || true
    wait || true
    echo "dptrain: a rank exited with code $status; stopped the others" >&2
    exit "$status"
done
