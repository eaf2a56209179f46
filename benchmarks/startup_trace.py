"""Where the start-up of one `dptrain train` run goes: each phase of each process, on one clock.

    python benchmarks/startup_trace.py [--src SRC] [--out FILE] [-- TRAIN FLAGS]

Runs `python -m dptrain train --dataset digits --model mlp --workers 2 --epochs 1 --no-progress`
(or the flags after `--`) once, with a `sitecustomize` on PYTHONPATH that every process of the
run (the launcher and its workers) imports first. It stamps the seconds since the command began
when each process's interpreter is up, and when each of a list of phases begins and ends: the
import of `dptrain.train.command` (which imports torch) and of `torch._dynamo` (which the first
optimizer imports), argument parsing, validation, the run directory, the rendezvous, the data,
the model, the trainer, training and teardown. Nothing in dptrain is changed; the timeline
goes to stdout (and to FILE, as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--epochs", "1", "--no-progress"]

SITECUSTOMIZE = r'''
import importlib.abc, os, sys, time

_T0 = float(os.environ["DPTRAIN_TRACE_T0"])
_WHO = "launcher" if "RANK" not in os.environ else "rank" + os.environ["RANK"]


def _stamp(event):
    sys.stderr.write(f"TRACE {time.time() - _T0:.3f} {os.getpid()} {_WHO} {event}\n")
    sys.stderr.flush()


_stamp("interpreter up")
# module -> functions (Class.method for methods) whose calls are phases
_PHASES = {
    "dptrain.cli": ["parse_args"],
    "dptrain.runtime.prestart": ["prestart", "receive"],
    "dptrain.runtime.spawn": ["Ranks.release"],
    "dptrain.train.command": ["validate", "prepare_run_dir", "run_worker", "load_data", "make_model"],
    "dptrain.runtime.launcher": ["launch_local"],
    "dptrain.runtime.distributed": ["init_process_group", "destroy_process_group", "exit_process"],
    "dptrain.train.trainer": ["Trainer.__init__", "Trainer.fit"],
}
_IMPORTS = {"dptrain.train.command", "torch._dynamo"}  # whose import is a phase


def _wrap(owner, name, label):
    original = getattr(owner, name)

    def traced(*args, **kwargs):
        _stamp(f"begin {label}")
        try:
            return original(*args, **kwargs)
        finally:
            _stamp(f"end {label}")

    traced.__wrapped__ = original
    setattr(owner, name, traced)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PHASES and name not in _IMPORTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            if name in _IMPORTS:
                _stamp(f"begin import {name}")
            execute(module)
            if name in _IMPORTS:
                _stamp(f"end import {name}")
            for qualified in _PHASES.get(name, []):
                owner, _, attr = qualified.rpartition(".")
                _wrap(getattr(module, owner) if owner else module, attr, qualified)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def timeline(lines: list[str]) -> list[dict]:
    """Phases (who, what, begin, end) from the TRACE lines, in order of their beginning."""
    open_, phases = {}, []
    for line in lines:
        _, at, pid, who, kind, *rest = line.split()
        at, what = float(at), " ".join(rest)
        if kind == "begin":
            open_.setdefault((pid, what), []).append(at)
        elif kind == "end" and open_.get((pid, what)):
            phases.append({"who": who, "what": what, "begin": open_[(pid, what)].pop(), "end": at})
        else:
            phases.append({"who": who, "what": f"{kind} {what}".strip(), "begin": at, "end": at})
    whose = {line.split()[2]: line.split()[3] for line in lines}
    for (pid, what), starts in open_.items():  # began and never returned (exit_process ends the process)
        phases += [{"who": whose[pid], "what": what + " (does not return)", "begin": at, "end": at} for at in starts]
    return sorted(phases, key=lambda p: (p["begin"], p["end"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(HERE.parent / "src"), help="the dptrain source tree (default: this one)")
    parser.add_argument("--out", type=Path, help="also write the timeline here, as JSON")
    parser.add_argument("flags", nargs="*", help="dptrain train flags (after --); --out is added")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, args.src]), "DPTRAIN_TRACE_T0": repr(time.time())}
        began = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "dptrain", "train", *(args.flags or DEFAULT),
                                 "--out", str(Path(tmp) / "run")], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
    traces = [line.split("] ", 1)[-1] for line in result.stderr.splitlines() if "TRACE " in line]
    phases = timeline([line[line.index("TRACE "):] for line in traces])
    print(f"{'begin':>7} {'end':>7} {'took':>6}  process   phase")
    for p in phases:
        print(f"{p['begin']:7.3f} {p['end']:7.3f} {p['end'] - p['begin']:6.3f}  {p['who']:9s} {p['what']}")
    print(f"whole process: {wall:.3f} s, exit code {result.returncode}")
    if result.returncode:
        print(result.stderr[-3000:], file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"command": args.flags or DEFAULT, "seconds": wall, "code": result.returncode,
                                        "load_average_1min": os.getloadavg()[0], "phases": phases}, indent=2) + "\n")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
