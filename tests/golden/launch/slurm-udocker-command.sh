#!/bin/bash
# SLURM job: 4 ranks (2 nodes x 2 tasks), each in udocker container dptrain.
# Every rank runs: python train.py --epochs 3
# Written by dptrain launch; rerun it rather than editing this file (--sbatch-option and --setup add a site's own lines).
#SBATCH --job-name=dptrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --gpus-per-node=2
#SBATCH --time=01:30:00
#SBATCH --partition=gpu
#SBATCH --account=proj42
#SBATCH --output=/home/ada/project/runs/mine/slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=USR1@300
set -euo pipefail
cd /home/ada/project

# Rendezvous: rank 0 runs on the first node of the allocation, reached at the address SLURM
# itself uses for that node; every rank derives the same port from SLURM_JOB_ID.
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(scontrol show node "$first_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
export MASTER_ADDR="${MASTER_ADDR:-$first_node}"
export OMP_NUM_THREADS=4
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
echo "dptrain: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR"

# The command meets its world as under torchrun: init_process_group("env://") reads MASTER_ADDR,
# MASTER_PORT, WORLD_SIZE and RANK (each rank's own, set as it starts; LOCAL_RANK too).
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 DPTRAIN_RUN_DIR=/home/ada/project/runs/mine

# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it
# offline. As root udocker needs --allow-root; a normal user needs nothing.
# GPUs: the container holds the host's NVIDIA libraries once 'dptrain container setup --nvidia' has run
# on a GPU node; udocker run has no flag for them.
udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/udocker.conf")
if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi

# One process per rank (one container each); if one fails, srun stops the others.
# SIGUSR1 reaches every rank before the time limit (or at a pre-emption warning); it starts
# ignored, so a program that installs no handler for it runs on. Ranks that save their state
# and exit with 75, as dptrain train's do, have the job requeued to resume from it.
status=0
srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=4 bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; trap "" USR1; exec "$@"' rank "${udocker[@]}" run --nobanner --hostenv -v /etc/hosts -v /home/ada/project -v /scratch/ada/data -w /home/ada/project dptrain python train.py --epochs 3 || status=$?
if [ "$status" -eq 75 ]; then
    echo "dptrain: job $SLURM_JOB_ID stopped to be resumed (its ranks exited with 75); requeueing it"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
