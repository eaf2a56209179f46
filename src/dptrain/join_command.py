"""`dptrain join RUN_DIR`: one more worker for a run that is training on this machine.

A run started by `dptrain train --min-workers N` (or `--workers MIN:MAX`) goes on without a lost
worker. While it runs, its launcher serves the workers' store and writes where in RUN_DIR/join.address.
`dptrain join` runs one worker of that run in this process: it takes the next rank of the job,
prepares everything that needs no other worker (data, model), then waits until a place is free
(fewer workers than the run started with, or than its --max-workers) and the run admits it at an epoch end. It then takes the
whole state of a live worker (model, optimizer, schedule, strategy state, epoch, history) over the
new group, not from disk, and trains with the others to the end (dptrain.runtime.membership).

A worker that finds no free place before the run ends exits with 0 and says so: it can wait as a spare.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dptrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Add one worker to a run training on this machine that goes on without lost workers "
                          "(dptrain train --min-workers N, or --workers MIN:MAX): it enters at an epoch end "
                          "where a place is free, healed from a live worker, and trains to the end of the run.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running job (its --out)")


def main(args: argparse.Namespace) -> int:
    from dptrain.config import RUN_SETTINGS, read_yaml
    from dptrain.runtime.launcher import read_join_record
    from dptrain.runtime.signed import SECRET_ENV
    from dptrain.train.rundir import JOIN_FILE

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"'{run_dir}' is not a run directory (it has no config.yaml); give the --out of a "
                        "running dptrain train")
    settings = read_yaml(run_dir / "config.yaml", "run settings file", RUN_SETTINGS)
    if settings.get("shard", "none") != "none":
        raise UserError(f"the run in '{run_dir}' shards its model (--shard {settings['shard']}), which takes no "
                        "worker from dptrain join: a replica group joins whole, in place of a lost one, started by the "
                        "run's launcher (--replace-workers); the groups left go on without one")
    address = run_dir / JOIN_FILE
    try:
        host, port, secret = read_join_record(address.read_text())
    except PermissionError:
        raise UserError(f"cannot read '{address}': only the user who runs the job in '{run_dir}' may add a worker "
                        "to it") from None
    except FileNotFoundError:
        raise UserError(f"no job in '{run_dir}' takes workers now: only a run training on this machine with "
                        f"--min-workers N or --workers MIN:MAX does, while it runs ({JOIN_FILE} says where)") from None
    if settings.get("strategy") == "async":
        raise UserError(f"the run in '{run_dir}' trains with strategy async, which takes no new worker: its workers "
                        "never stand at an epoch end together for one to enter at")
    workers = int(settings["workers"])
    # A worker of the job as its launcher starts one, taking its rank from the run's store (DPTRAIN_JOIN=new).
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(workers), WORLD_SIZE=str(workers),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", DPTRAIN_LAUNCHER="local", DPTRAIN_JOIN="new",
                      DPTRAIN_STORE_SERVED="1", **({SECRET_ENV: secret} if secret else {}))
    from dptrain.runtime.prestart import quiet_cpp_logs_of_children

    quiet_cpp_logs_of_children()  # before torch is imported: as for the workers the launcher started
    from dptrain.arguments import train_config
    from dptrain.train.command import train

    code = train(train_config(["--config", str(run_dir / "config.yaml")]))
    if code == 0:
        print(f"dptrain: this worker (rank {os.environ.get('RANK')}) trained with the others to the end of the "
              f"run in {run_dir}", flush=True)
    return code
