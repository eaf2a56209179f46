"""`dptrain serve-store`: a job's rendezvous store in a process of its own, so that any rank may be lost.

Without it, rank 0 serves the store its job meets at, and a job whose rank 0 dies cannot go on. With
`--min-workers`, dptrain's local launcher serves the store itself, and `dptrain launch`'s SLURM job
script starts this command on the batch host (the allocation's first node, MASTER_ADDR) before srun.
The ranks join it (DPTRAIN_STORE_SERVED=1) as clients, rank 0 too; losing rank 0 then only makes the
ranks left choose a new one (dptrain.runtime.membership). It serves until it gets SIGTERM or SIGINT
(the job script stops it when srun is done), or until --lifetime seconds have passed.

With --run-dir it writes where it serves to RUN_DIR/join.address once the run has started (its
config.yaml is there), so that `dptrain join RUN_DIR` adds a worker from any node of the job; it
removes the file when it stops. With --replace N it also starts a new worker for each of up to N ranks
the others went on without (the ranks record each one they leave out in the store): it runs
--replace-command, which the SLURM job script makes a new step (`srun --overlap --nodes=1 --ntasks=1
... dptrain join RUN_DIR`) and the PBS one `dptrain join RUN_DIR` on its first node; the new worker
enters at the next epoch end, healed from a live one.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dptrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve a job's rendezvous store at HOST:PORT for WORLD ranks, so that any of them may be "
                          "lost (rank 0 too): dptrain launch's SLURM job scripts start it with --min-workers.")
    parser.add_argument("--host", required=True, help="the address the ranks meet at (their MASTER_ADDR)")
    parser.add_argument("--port", type=int, required=True, help="the port (their MASTER_PORT)")
    parser.add_argument("--world", type=int, required=True, help="the job's ranks (their WORLD_SIZE)")
    parser.add_argument("--lifetime", type=float, default=None,
                        help="seconds to serve at most (default: until SIGTERM or SIGINT)")
    parser.add_argument("--run-dir", default=None, help="the run's directory: while serving, RUN_DIR/join.address "
                        "says where (for dptrain join RUN_DIR)")
    parser.add_argument("--replace", type=int, default=0, metavar="N",
                        help="start a new worker for each of up to N ranks the others go on without (default 0)")
    parser.add_argument("--replace-command", default=None, metavar="COMMAND",
                        help="with --replace: the command line that starts one new worker, e.g. "
                             "'srun --overlap --nodes=1 --ntasks=1 dptrain join RUN_DIR'")


POLL = 0.5  # seconds between looks at the run directory and at the ranks left out
CHILD_GRACE = 10.0  # seconds a new worker still running when the store stops has to end (a spare goes home)


def main(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise UserError(f"--world {args.world} must be at least 1 (the job's ranks)")
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} must be between 1 and 65535")
    if args.replace < 0:
        raise UserError(f"--replace {args.replace} must be 0 or more (the new workers to start at most)")
    if args.replace and not args.replace_command:
        raise UserError(f"--replace {args.replace} needs --replace-command, the command line that starts a new worker")
    if args.replace_command and not shlex.split(args.replace_command):
        raise UserError(f"--replace-command {args.replace_command!r} is empty; give the command line that starts a new worker")
    import datetime

    import torch.distributed as dist

    from dptrain.io import write_text
    from dptrain.runtime.distributed import listen_exactly
    from dptrain.runtime.launcher import join_record
    from dptrain.runtime import signed
    from dptrain.runtime.membership import lost_since
    from dptrain.runtime.store_keys import REPLACING, WORLD
    from dptrain.runtime.spawn import job_store
    from dptrain.train.rundir import JOIN_FILE

    where = f"the job's store at {args.host}:{args.port}"
    listener = listen_exactly(args.host, args.port, where)
    store = dist.TCPStore(args.host, args.port, None, True, datetime.timedelta(seconds=300), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    ranks = job_store(store)
    signed.put(ranks, WORLD, str(args.world))  # joiners take the ranks after the job's first ones
    if args.replace:
        signed.put(ranks, REPLACING, str(args.replace))  # the ranks' --replace-workers is kept
    print(f"dptrain: serving {where} for {args.world} ranks", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    run_dir = Path(args.run_dir) if args.run_dir else None
    join_file = run_dir / JOIN_FILE if run_dir is not None else None
    deadline = None if args.lifetime is None else time.monotonic() + args.lifetime
    written, seen, left, started = False, 0, args.replace, []
    try:
        while not stop.wait(POLL if deadline is None else max(0.0, min(POLL, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                break
            # The store must outlive anything going wrong here: each failure is said once, and serving goes on.
            if join_file is not None and not written and (run_dir / "config.yaml").is_file():
                try:
                    write_text(join_file, join_record(args.host, args.port))
                    written = True
                except OSError as exc:
                    print(f"dptrain: cannot write {join_file} ({exc.strerror or exc}); dptrain join will not find "
                          "this run", flush=True)
                    join_file = None
            if left > 0:
                try:
                    seen, lost = lost_since(ranks, seen)
                    for rank in lost[:left]:
                        left -= 1
                        print(f"dptrain: starting a new worker in place of rank {rank} ({left} more may be "
                              f"replaced): {args.replace_command}", flush=True)
                        started.append(subprocess.Popen(shlex.split(args.replace_command)))
                except Exception as exc:  # noqa: BLE001 - a command that cannot start, a store call that fails
                    print(f"dptrain: no more new workers in place of lost ranks: {type(exc).__name__}: {exc}",
                          flush=True)
                    left = 0
    finally:
        if written:
            join_file.unlink(missing_ok=True)
        _end(started)
    sys.stdout.flush()
    return 0


def _end(children: list) -> None:
    """New workers still running when the store stops: each has CHILD_GRACE seconds to end (a spare sees
    that the run finished and goes home), then is terminated."""
    deadline = time.monotonic() + CHILD_GRACE
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.terminate()
