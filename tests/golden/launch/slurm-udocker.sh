#!/bin/bash
# SLURM job: 4 ranks (2 nodes x 2 tasks), each in udocker container dptrain.
# Written by dptrain launch; rerun it rather than editing this file (--sbatch-option and --setup add a site's own lines).
#SBATCH --job-name=dptrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --gpus-per-node=2
#SBATCH --time=01:30:00
#SBATCH --partition=gpu
#SBATCH --account=proj42
#SBATCH --output=/home/ada/project/runs/digits-sync/slurm-%j.out
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

# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it
# offline. As root udocker needs --allow-root; a normal user needs nothing.
# GPUs: the container holds the host's NVIDIA libraries once 'dptrain container setup --nvidia' has run
# on a GPU node; udocker run has no flag for them.
udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/udocker.conf")
if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi

# One process per rank (one container each); if one fails, srun stops the others.
# SIGUSR1 before the time limit (or a pre-emption warning) makes every rank save a checkpoint
# after its current epoch and exit with 75; the job then requeues itself and resumes from it.
status=0
srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=4 bash -c 'trap "" USR1 USR2 TERM; exec "$@"' rank "${udocker[@]}" run --nobanner --hostenv -v /etc/hosts -v /home/ada/project -v /scratch/ada/data -w /home/ada/project dptrain dptrain train --dataset digits --strategy sync --epochs 10 --out /home/ada/project/runs/digits-sync || status=$?
if [ "$status" -eq 75 ]; then
    echo "dptrain: job $SLURM_JOB_ID stopped at a checkpoint; requeueing it to resume"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
