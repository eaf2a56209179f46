"""`dptrain serve-store`: a job's rendezvous store in a process of its own, so that any rank may be lost.

Without it, rank 0 serves the store its job meets at, and a job whose rank 0 dies cannot go on. With
`--min-workers`, dptrain's local launcher serves the store itself, and `dptrain launch`'s SLURM job
script starts this command on the batch host (the allocation's first node, MASTER_ADDR) before srun.
The ranks join it (DPTRAIN_STORE_SERVED=1) as clients, rank 0 too; losing rank 0 then only makes the
ranks left choose a new one (dptrain.runtime.membership). It serves until it gets SIGTERM or SIGINT
(the job script stops it when srun is done), or until --lifetime seconds have passed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from dptrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve a job's rendezvous store at HOST:PORT for WORLD ranks, so that any of them may be "
                          "lost (rank 0 too): dptrain launch's SLURM job scripts start it with --min-workers.")
    parser.add_argument("--host", required=True, help="the address the ranks meet at (their MASTER_ADDR)")
    parser.add_argument("--port", type=int, required=True, help="the port (their MASTER_PORT)")
    parser.add_argument("--world", type=int, required=True, help="the job's ranks (their WORLD_SIZE)")
    parser.add_argument("--lifetime", type=float, default=None,
                        help="seconds to serve at most (default: until SIGTERM or SIGINT)")


def main(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise UserError(f"--world {args.world} must be at least 1 (the job's ranks)")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} must be between 1 and 65535")
    import datetime

    import torch.distributed as dist

    from dptrain.runtime.distributed import _listen
    from dptrain.runtime.membership import WORLD
    from dptrain.runtime.spawn import job_store

    where = f"the job's store at {args.host}:{args.port}"
    listener = _listen(args.host, args.port, where)
    store = dist.TCPStore(args.host, args.port, None, True, datetime.timedelta(seconds=300), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    job_store(store).set(WORLD, str(args.world))  # joiners take the ranks after the job's first ones
    print(f"dptrain: serving {where} for {args.world} ranks", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait(args.lifetime)
    sys.stdout.flush()
    return 0
