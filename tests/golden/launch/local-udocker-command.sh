#!/bin/bash
# Local job: 2 ranks (1 node x 2 tasks), each in udocker container dptrain.
# Every rank runs: python train.py --epochs 3
# Written by dptrain launch; rerun it rather than editing this file.
set -euo pipefail
cd /home/ada/project
export OMP_NUM_THREADS=1
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"

# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it
# offline. As root udocker needs --allow-root; a normal user needs nothing.
udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/udocker.conf")
if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi

# Rendezvous on this machine; the port is derived from this script's PID, like a job id.
# The command meets its world as under torchrun: init_process_group("env://") reads MASTER_ADDR,
# MASTER_PORT, WORLD_SIZE and RANK (each rank's own; LOCAL_RANK too).
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000)) WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 DPTRAIN_RUN_DIR=/home/ada/project/runs/mine

# One container per rank.
pids=()
for rank in $(seq 0 1); do
    RANK=$rank LOCAL_RANK=$rank "${udocker[@]}" run --nobanner --hostenv -v /etc/hosts -v /home/ada/project -v /scratch/ada/data -w /home/ada/project dptrain python train.py --epochs 3 &
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
