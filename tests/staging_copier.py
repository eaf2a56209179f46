"""One process staging shards, as the first process of a node does (for tests/test_staging_background.py).

    python staging_copier.py FOLDER LOG GO SHARD...

Makes a dptrain.data.staging.Staging of the SHARDs into FOLDER, says it is ready (a file READY-<pid> beside GO),
waits for GO to exist (so that two such processes begin at once), copies, and prints one JSON line: the copy's
record, the time its copy began, and for each shard whether it is now read from FOLDER with its original's bytes.
Each shard copy is logged to LOG as "<pid> <shard> <time it ended>" (one appended write a line)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dptrain.data import staging


def main(folder: str, log: str, go: str, *paths: str) -> None:
    real = staging._copy_file

    def logged(source, partial, stop):
        real(source, partial, stop)
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {source} {time.time()}\n")

    staging._copy_file = logged
    stager = staging.Staging(list(paths), folder)
    Path(go).with_name(f"READY-{os.getpid()}").touch()
    while not Path(go).exists():
        time.sleep(0.005)
    began = time.time()
    stager.start(list(range(len(paths))))
    if not stager.wait(60):
        raise SystemExit("the copy did not end within 60 s")
    usable = [stager.where(path) != path and Path(stager.where(path)).read_bytes() == Path(path).read_bytes()
              for path in paths]
    print(json.dumps({"record": stager.record, "began": began, "usable": usable}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
