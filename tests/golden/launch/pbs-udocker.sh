#!/bin/bash
# PBS job: 4 ranks (2 nodes x 2 tasks), each in udocker container dptrain.
# Written by dptrain launch; rerun it rather than editing this file (--pbs-option and --setup add a site's own lines).
#PBS -N dptrain
#PBS -l select=2:ncpus=8:mpiprocs=2:ngpus=2
#PBS -l place=scatter
#PBS -V
#PBS -l walltime=01:30:00
#PBS -q gpu
#PBS -A proj42
#PBS -j oe
#PBS -o /home/ada/project/runs/digits-sync/pbs-last.out
set -euo pipefail
exec >>/home/ada/project/runs/digits-sync/pbs.out 2>&1  # after the output of the jobs before it
cd /home/ada/project

# Rendezvous: rank 0 runs on the first host of PBS_NODEFILE; every rank derives the same port
# from PBS_JOBID. mpirun hands both to the ranks on other nodes with -x.
MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")
export MASTER_ADDR
export OMP_NUM_THREADS=4
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
echo "dptrain: job $PBS_JOBID on $(sort -u "$PBS_NODEFILE" | paste -sd,), rendezvous $MASTER_ADDR"

# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it
# offline. As root udocker needs --allow-root; a normal user needs nothing.
# GPUs: the container holds the host's NVIDIA libraries once 'dptrain container setup --nvidia' has run
# on a GPU node; udocker run has no flag for them.
udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/udocker.conf")
if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi

# Ranks on other nodes start in their own environment: mpirun hands them these variables, and
# where the program and its modules are found (PATH, PYTHONPATH, the virtualenv) when set.
forward=(-x MASTER_ADDR -x PBS_JOBID -x OMP_NUM_THREADS -x TORCH_CPP_LOG_LEVEL)
for name in PATH PYTHONPATH VIRTUAL_ENV LD_LIBRARY_PATH; do
    if [ -n "${!name:-}" ]; then forward+=(-x "$name"); fi
done

# One process per rank (one container each), started by the host's Open MPI.
mpirun -np 4 --hostfile "$PBS_NODEFILE" --map-by ppr:2:node --bind-to none "${forward[@]}" bash -c 'trap "" USR1; exec "$@"' rank "${udocker[@]}" run --nobanner --hostenv -v /etc/hosts -v /home/ada/project -v /scratch/ada/data -w /home/ada/project dptrain dptrain train --dataset digits --strategy sync --epochs 10 --out /home/ada/project/runs/digits-sync &
launcher=$!
# SIGUSR1 300 s before the walltime (PBS has no --signal): mpirun passes it on to
# every rank, which saves a checkpoint and exits with 75.
(sleep 5100 </dev/null >/dev/null 2>&1; echo "dptrain: job $PBS_JOBID is 300 s from its walltime; sending SIGUSR1 to the ranks"; kill -s USR1 "$launcher") &
timer=$!
status=0
wait "$launcher" || status=$?
kill "$timer" 2>/dev/null || true

# Ranks that saved their state and exited with 75 are resumed by the same script, submitted again to
# start after this job (qrerun needs PBS operator privilege); at most 10 times (--max-requeues).
requeues=${DPTRAIN_REQUEUES:-0}
if [ "$status" -eq 75 ] && [ "$requeues" -lt 10 ]; then
    next=$(DPTRAIN_REQUEUES=$((requeues + 1)) qsub -W depend=afterany:"$PBS_JOBID" /home/ada/project/runs/digits-sync/job.pbs)
    echo "$next" > /home/ada/project/runs/digits-sync/pbs-requeued-$PBS_JOBID
    echo "dptrain: job $PBS_JOBID stopped to be resumed (exit code 75); requeued as job $next (requeue $((requeues + 1)) of 10)"
    exit 0
fi
exit "$status"
