"""The benchmark matrix: strategies x worker counts x repeats, plus plain PyTorch baselines, in one run.

`plan` lists the runs (pure); `run_matrix` executes them one after the other, each rank a
process (in its own emulated host when a bandwidth is given), and collects one results row
per run. Repeats are interleaved (all runs once, then all again) so that slow phases of a
shared machine spread over every configuration instead of hitting one.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from dptrain.bench.netns import INTERFACE, EmulatedNetwork, measure_link
from dptrain.bench.processes import run_ranks
from dptrain.bench.results import add_scaling, read_run, run_row, summarise
from dptrain.config import build_config, flag_of, to_yaml
from dptrain.data import load_dataset
from dptrain.errors import UserError
from dptrain.train.rundir import claim_run_dir
from dptrain.runtime.env import free_port

BASELINES_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "baselines"
BASELINE_OPTIONS = ("dataset", "model", "samples", "image_size", "epochs", "batch_size", "lr", "momentum", "seed")
# Settings of dptrain's own runs that leave what is trained unchanged: the baselines need not follow them.
DPTRAIN_ONLY = ("shuffle", "timeout", "checkpoint_every", "checkpoint_every_steps", "keep_checkpoints")


@dataclass(frozen=True)
class Run:
    """One run of the matrix: a dptrain strategy or a baseline script, on `workers` ranks."""

    kind: str  # "dptrain" | "baseline"
    strategy: str  # a dptrain strategy, or plain-loop | plain-ddp | horovod
    workers: int
    repeat: int

    @property
    def name(self) -> str:
        return f"{self.strategy}-w{self.workers}-r{self.repeat}"


@dataclass
class BenchSpec:
    strategies: list[str]
    workers: list[int]
    train: dict  # TrainConfig fields shared by every run (model, dataset, epochs, batch_size, ...)
    target_accuracy: Optional[float] = None
    bandwidth: Optional[str] = None
    slow_worker: Optional[str] = None
    repeat: int = 1
    baselines: bool = True
    timeout: float = 1800.0
    threads: Optional[int] = None  # OMP_NUM_THREADS of every rank; None: cores / ranks
    ranks_per_host: int = 1  # ranks [kN, (k+1)N) share emulated host k; hierarchical runs get --ranks-per-node N
    notes: list[str] = field(default_factory=list)


def horovod_available() -> bool:
    return importlib.util.find_spec("horovod") is not None and shutil.which("horovodrun") is not None


def plan(spec: BenchSpec, baselines_present: bool, horovod: bool) -> list[Run]:
    """Every run, repeats interleaved: the strategies at each worker count, then the baselines
    (the plain loop once per repeat, plain DDP and Horovod at each worker count above 1)."""
    runs = []
    for repeat in range(spec.repeat):
        for workers in spec.workers:
            runs += [Run("dptrain", strategy, workers, repeat) for strategy in spec.strategies]
        if spec.baselines and baselines_present:
            runs.append(Run("baseline", "plain-loop", 1, repeat))
            runs += [Run("baseline", "plain-ddp", n, repeat) for n in spec.workers if n > 1]
            if horovod and not spec.bandwidth:
                runs += [Run("baseline", "horovod", n, repeat) for n in spec.workers if n > 1]
    return runs


def check(spec: BenchSpec) -> None:
    """Validate the shared training settings once, as `dptrain train` would, before any run."""
    from dptrain.train.command import validate

    for workers in spec.workers:
        for strategy in spec.strategies:  # each strategy's settings, before any run (cheap)
            _config(spec, strategy, workers, out=None)
        validate(_config(spec, _reference_strategy(spec), workers, out=None))
    unsupported = sorted(key for key in spec.train if key not in BASELINE_OPTIONS and key not in DPTRAIN_ONLY)
    if spec.baselines and unsupported:
        raise UserError(f"the baseline scripts cannot reproduce {', '.join(unsupported)}; leave those options out "
                        "or add --no-baselines")


def _reference_strategy(spec: BenchSpec) -> str:
    """The strategy whose config check() validates and the baselines copy: the first one asked for, since a
    setting such as sync_every_steps is valid for some strategies only (allreduce when none is asked for)."""
    return spec.strategies[0] if spec.strategies else "allreduce"


def _config(spec: BenchSpec, strategy: str, workers: int, out: Optional[str]):
    values = {**spec.train, "strategy": strategy, "workers": workers, "out": out, "progress": False}
    if strategy == "hierarchical" and spec.ranks_per_host > 1 and workers > 1:
        values["ranks_per_node"] = spec.ranks_per_host  # the namespaces share one host name: say where nodes end
    if spec.slow_worker and workers > 1:
        values["slow_worker"] = ",".join(part for part in spec.slow_worker.split(",") if int(part.split(":")[0]) < workers) or None
    return build_config(values, "the bench settings")


def run_matrix(spec: BenchSpec, out: Path) -> dict:
    """Run every planned run under OUT/runs/NAME; return {'runs', 'summary', 'network', 'notes'}."""
    check(spec)
    baselines_present = (BASELINES_DIR / "plain_ddp.py").is_file()
    if spec.baselines and not baselines_present:
        spec.notes.append(f"baselines skipped: {BASELINES_DIR} is not there (dptrain installed without its repository)")
    horovod = horovod_available()
    if spec.baselines and not horovod:
        spec.notes.append("horovod skipped: it is not importable (see `make horovod`)")
    elif spec.baselines and spec.bandwidth:
        spec.notes.append("horovod skipped: horovodrun cannot place ranks in the emulated hosts")
    runs = plan(spec, baselines_present, horovod)
    base = _config(spec, _reference_strategy(spec), 1, None)
    data = load_dataset(base.dataset if base.data is None else None, data_path=base.data, seed=base.seed,
                        samples=base.samples, image_size=base.image_size, channels=base.channels,
                        classes=base.classes, features=base.features)
    train_samples = len(data.x_train)
    hosts = -(-max(spec.workers) // spec.ranks_per_host)
    network_info: dict = {"name": spec.bandwidth or "loopback"}
    rows = []
    network = EmulatedNetwork(hosts, spec.bandwidth) if spec.bandwidth else nullcontext(None)
    with network as net:
        if net is not None and hosts > 1:
            network_info.update(measure_link(net))
        for run in tqdm(runs, desc="bench", unit="run", dynamic_ncols=True):
            run_dir = claim_run_dir(str(out / "runs" / run.name))  # the run's own directory, marked as one
            seconds = _execute(spec, run, run_dir, net, base)
            summary, metrics = read_run(run_dir)
            rows.append(run_row(summary, metrics, kind=run.kind, repeat=run.repeat, network=network_info["name"],
                                target=spec.target_accuracy, process_seconds=seconds, train_samples=train_samples,
                                batch_size=base.batch_size, run_dir=str(run_dir.relative_to(out))))
    add_scaling(rows)
    return {"runs": rows, "summary": summarise(rows), "network": network_info, "notes": spec.notes}


def _execute(spec: BenchSpec, run: Run, run_dir: Path, net: Optional[EmulatedNetwork], base) -> float:
    """Start the ranks of one run and wait for them; return wall seconds including process start-up.
    `base` is the validated 1-worker allreduce config, whose settings the baselines copy."""
    ranks = run.workers
    if run.kind == "dptrain":
        config = _config(spec, run.strategy, run.workers, out=str(run_dir))
        (run_dir / "config.yaml").write_text(to_yaml(config))
        command = [sys.executable, "-m", "dptrain", "train", "--config", str(run_dir / "config.yaml")]
    elif run.strategy == "horovod":  # horovodrun starts the ranks itself
        command = ["horovodrun", "--gloo", "-np", str(run.workers), "-H", f"localhost:{run.workers}",
                   sys.executable, str(BASELINES_DIR / "plain_horovod.py"), *_baseline_flags(base, run_dir)]
        ranks = 1
    else:
        script = "plain_loop.py" if run.strategy == "plain-loop" else "plain_ddp.py"
        command = [sys.executable, str(BASELINES_DIR / script), *_baseline_flags(base, run_dir)]
    hosts = {} if net is None else dict(master_addr=net.address(0),
                                        prefix=lambda rank: net.exec_prefix(rank // spec.ranks_per_host),
                                        extra_env={"GLOO_SOCKET_IFNAME": INTERFACE})
    return run_ranks(command, ranks, run_dir, port=free_port(), threads=spec.threads, timeout=spec.timeout, **hosts)


def _baseline_flags(config, run_dir: Path) -> list[str]:
    flags = []
    for key in BASELINE_OPTIONS:
        value = getattr(config, key)
        if value is not None:
            flags += [flag_of(key), str(value)]
    return flags + ["--out", str(run_dir)]
