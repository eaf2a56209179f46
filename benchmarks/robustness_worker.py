"""One rank of a group of robustness-benchmark runs: `dptrain run --workers W robustness_worker.py JOBS.json`.

JOBS.json is a list of {"id": ..., "argv": [dptrain train flags]}, the same list on every rank. This
process joins the group `dptrain run` describes once (importing torch and joining cost ~3 s per
rank on a 2-core machine, more than a small run's training), then trains each job in turn on that
group, exactly as `dptrain train` would with those flags: the flags become a TrainConfig through
`dptrain train`'s own parser (dptrain.arguments.train_config) and the run goes through
dptrain.train.command.train_in_group, the body of every rank of `dptrain train`.

A job that fails on a rank (an exception, e.g. training diverged) ends this process: it prints one
line `ROBUSTNESS-FAILED {"id": ..., "rank": ..., "error": ...}`, `dptrain run` stops the other ranks
and the harness (benchmarks/robustness.py) records the failure and starts the rest again.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

FAILED = "ROBUSTNESS-FAILED "
DONE = "ROBUSTNESS-DONE "
TIMEOUT = 120.0  # seconds any wait on another rank may take (joining, collectives)


def main(jobs_file: str) -> int:
    from dptrain.arguments import train_config
    from dptrain.runtime.distributed import destroy_process_group, exit_process, init_process_group, set_cpu_threads
    from dptrain.runtime.env import detect
    from dptrain.train.command import train_in_group

    jobs = json.loads(Path(jobs_file).read_text())
    set_cpu_threads()
    env = detect()
    ctx = init_process_group(env, device="cpu", timeout=TIMEOUT)
    for job in jobs:
        held = contextlib.ExitStack()  # rank 0's lock on the job's run directory
        started = time.perf_counter()
        try:
            train_in_group(train_config(job["argv"]), env, ctx, held)
        except BaseException as error:  # noqa: BLE001 - reported for the harness, then this rank ends
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(FAILED + json.dumps({"id": job["id"], "rank": ctx.rank, "type": type(error).__name__,
                                       "error": message}), flush=True)
            if not isinstance(error, Exception) or type(error).__name__ not in ("Diverged", "UserError"):
                traceback.print_exc()
            sys.stderr.flush()
            exit_process(1)
        finally:
            held.close()
        if ctx.is_main:
            print(DONE + json.dumps({"id": job["id"], "seconds": round(time.perf_counter() - started, 2)}), flush=True)
    destroy_process_group()
    exit_process(0)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: dptrain run --workers W benchmarks/robustness_worker.py JOBS.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
