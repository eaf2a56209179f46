"""A user's own distributed program, as `dptrain launch ... -- python script.py FACTOR` runs it on every rank.

Plain PyTorch: init_process_group from the environment the job script sets (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK), one all_reduce of (RANK + 1) * FACTOR; rank 0 writes the sum to
$DPTRAIN_RUN_DIR/sum.txt, and every rank writes where it ran to rank-RANK.txt: node, local rank,
world size, and whether in a udocker container (which marks its processes with container_uuid).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([(rank + 1) * float(sys.argv[1])])
dist.all_reduce(value)
run_dir = os.environ["DPTRAIN_RUN_DIR"]
node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
with open(os.path.join(run_dir, f"rank-{rank}.txt"), "w") as handle:
    inside = "udocker" if "container_uuid" in os.environ else "host"
    handle.write(f"{node} {os.environ['LOCAL_RANK']} {world} {inside}\n")
if rank == 0:
    with open(os.path.join(run_dir, "sum.txt"), "w") as handle:
        handle.write(f"{value.item():g}\n")
dist.destroy_process_group()
