#!/bin/bash
# Local job: 2 ranks (1 node x 2 tasks).
# Written by dptrain launch; rerun it rather than editing this file.
set -euo pipefail
cd /home/ada/project
export OMP_NUM_THREADS=1
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"

# dptrain's own launcher starts the ranks and stops them all if one fails.
exec dptrain train --dataset digits --strategy sync --epochs 10 --out /home/ada/project/runs/digits-sync --workers 2
