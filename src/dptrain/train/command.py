"""`dptrain train` from a TrainConfig: validate up front, spawn or join the workers, train, write the run.

The launching process validates everything a user can get wrong (config, data, model, run
directory) before any worker trains, so bad input fails once, with one line and exit code 2.
The local workers are started first and import torch meanwhile (dptrain.runtime.prestart);
they begin only once the run is valid, and are stopped unheard when it is not.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from dptrain import lr_policy, registry
from dptrain.config import BUILTIN_LOSSES, TrainConfig, build_config, recorded, to_yaml, with_absolute_paths
from dptrain.data import sharding
from dptrain.data.fingerprint import fingerprint
from dptrain.data.kinds import DataSplits, load_data
from dptrain.data.private import refuse_partitions, set_rank
from dptrain.data.sampler import as_dataset, loader
from dptrain.user_code import check_spec_file, load_callable
from dptrain.errors import Interrupted, Preempted, UserError
from dptrain.io import write_text
from dptrain.models import build_model, check_output_shape
from dptrain.models import check_name as check_model_name
from dptrain.runtime.distributed import (backend_for, choose_device, destroy_process_group, init_process_group,
                                         report_error, set_cpu_threads, store_served)
from dptrain.runtime.env import DistEnv, detect
from dptrain.runtime.launcher import NOT_RESTARTED, launch_local, stop_while_starting
from dptrain.runtime.prestart import prestart, quiet_cpp_logs_of_children
from dptrain.runtime.spawn import Ranks
from dptrain.strategies import build_strategy
from dptrain.strategies.rules.sharding import kept_ranks
from dptrain.train.optim import build_optimizer
from dptrain.train import checkpoint_files, loggers, reshard
from dptrain.train.rundir import (JOIN_FILE, check_not_busy, check_run_dir, default_run_dir, keep_finished,
                                  lock_run_dir, open_run_dir, run_id)
from dptrain.train.preemption import (STOP_SIGNALS, catch_stop_signals_early, release_early_stop_signals,
                                     take_early_stop_signal)
from dptrain.train.recorder import Summary, summary_line
from dptrain.train.checkpointer import describe_interruption, epochs_recorded, load_model_state, resume_refusal
from dptrain.train.trainer import Trainer, check_amp


def make_model(config: TrainConfig, data: DataSplits) -> torch.nn.Module:
    """The model, initialised identically on every rank (seeded before construction)."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.input_shape, data.num_outputs, options=config.model_options)
    if config.loss in BUILTIN_LOSSES:  # a loss of the user's own decides what outputs it needs
        # your own data may be read the other way (--task); a built-in data set knows its task
        check_output_shape(model, data.input_shape, data.num_outputs, read_as(data) if config.data else "")
    return model


def read_as(data: DataSplits) -> str:
    """What the data was read as, and the --task that reads it the other way (a wrong output shape is
    often a float label array read as regression targets, or numbers read as classes)."""
    if data.task == "classification":
        return (f"the data was read as classification with {data.num_classes} classes (integer labels "
                f"0..{data.num_classes - 1}); if its labels are numbers to predict, give --task regress")
    values = "value" if data.num_outputs == 1 else "values"
    return (f"the data was read as regression with {data.num_outputs} target {values} per sample (floating-point "
            "labels, or --task regress); if its labels are classes, give --task classify")


def loss_name(config: TrainConfig, data: DataSplits) -> str:
    if config.loss != "auto":
        return config.loss
    return "cross-entropy" if data.task == "classification" else "mse"


def build_loss(config: TrainConfig, data: DataSplits) -> Union[str, Callable]:
    """A built-in loss by name, or the user's function (`--loss package.module:function`)."""
    name = loss_name(config, data)
    if name in ("cross-entropy", "mse"):
        return name
    return load_callable(name, "--loss", "loss", "takes (output, target) and returns the loss")


def check_loss(loss: Union[str, Callable], spec: str, model: torch.nn.Module, data: DataSplits) -> None:
    """A built-in loss must fit the task; the user's must turn the model's output on two samples into one number."""
    if isinstance(loss, str):
        if (loss == "cross-entropy") != (data.task == "classification"):
            valid = "cross-entropy" if data.task == "classification" else "mse"
            raise UserError(f"--loss {loss} does not fit this {data.task} data set; use {valid} or auto")
        return
    batch = next(iter(loader(as_dataset(data.train_set()), [[0, 1]])))
    try:
        with torch.no_grad():
            value = loss(model(batch[0]).float(), batch[1])
    except Exception as error:  # noqa: BLE001 - the user's function: its failure in one line
        raise UserError(f"--loss {spec} failed on the model's output for two samples: "
                        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise UserError(f"--loss {spec} returned "
                        f"{type(value).__name__ if not isinstance(value, torch.Tensor) else f'a tensor of shape {tuple(value.shape)}'}; "
                        "it must return one number (a 0-d tensor), e.g. the mean over the batch")


def check_first(config: TrainConfig) -> None:
    """The checks that need neither the data nor a model, made before the data is read (a data factory may
    take long): the file a user's --model or --loss names, a built-in model's name, and a run in --out (in use
    by another run, finished, with other settings). A directory of other files is refused where the run
    directory is opened, after the data: a mistake in the data is the likelier one to fix first."""
    check_model_name(config.model)
    loggers.check([*(["tensorboard"] if config.tensorboard else []), *(config.log_to.split(",") if config.log_to else [])])
    if config.loss not in BUILTIN_LOSSES:
        check_spec_file(config.loss, "--loss")
    if config.out:
        check_not_busy(config.out)
        check_run_dir(config.out, with_absolute_paths(config.model_dump(mode="json")), config.resume, only_runs=True)


def validate(config: TrainConfig) -> torch.nn.Module:
    """Everything that can be checked before workers start: the cheap checks first, then data, model, loss,
    worker count. Returns the model."""
    return _validate(config)[0]


def _validate(config: TrainConfig) -> tuple[torch.nn.Module, DataSplits]:
    """validate(), returning the data too."""
    device = choose_device(config.device, 0)
    check_amp(config.amp, device)
    if backend_for(device) == "nccl" and not detect().launched and config.workers > torch.cuda.device_count():
        raise UserError(f"--workers {config.workers} needs a GPU each under NCCL, and {torch.cuda.device_count()} "
                        f"are visible; give --workers {torch.cuda.device_count()} or fewer, or --device cpu")
    check_first(config)
    data = load_data(config)
    model = make_model(config, data)
    check_loss(build_loss(config, data), config.loss, model, data)
    samples = len(data.train_set())
    if getattr(data.train_set(), "private", False):  # client 0's own data: no shard of a shared set to check
        refuse_partitions(config, config.data)
        registry.load("strategy", config.strategy).check_before_spawn(config, model)
        return model, data
    sharding.check_workers(samples, config.workers)
    if getattr(data.train_set(), "is_stream", False):
        from dptrain.data.streams import refuse_stream_run
        chosen = registry.load("strategy", config.strategy)
        refuse_stream_run(config.strategy, chosen.own_partitions, False, config.min_workers,
                          merges=chosen.meeting.at == "merges")
    registry.load("strategy", config.strategy).check_before_spawn(config, model)
    if config.batch_size > samples // config.workers:
        raise UserError(f"--batch-size {config.batch_size} is larger than a worker's shard of "
                        f"{samples // config.workers} samples ({samples} samples over "
                        f"{config.workers} workers); use at most {samples // config.workers}")
    if config.batch_size * config.accumulate > samples // config.workers:
        raise UserError(f"--accumulate {config.accumulate} with --batch-size {config.batch_size} makes a step of "
                        f"{config.batch_size * config.accumulate} samples per worker, more than a worker's shard of "
                        f"{samples // config.workers}; use --accumulate {max(1, samples // config.workers // config.batch_size)} "
                        "or fewer")
    return model, data


def _shard_size(config: TrainConfig, world: int, saved: dict) -> int:
    """This run's replica group size where it is known before the workers start; hybrid's default (the ranks of
    a node) is known to the ranks only, who check the checkpoint again: the checkpoint's size here."""
    if config.shard == "none":
        return 1
    return world if config.shard == "full" else config.shard_size or saved.get("shard_size", 1)


def prepare_run_dir(config: TrainConfig, out: str, world: int, model: torch.nn.Module,
                    data: Optional[DataSplits] = None) -> tuple[Path, bool]:
    """Open (or continue) the run directory; refuse unusable checkpoints before anything is written: corrupt,
    of another model, of another run, on other `data` than now, or of another world than `world` where the
    strategy cannot resume on another number of workers."""
    # Data, model and loss files as absolute paths: `dptrain train --config RUN/config.yaml` repeats the run
    # from anywhere (and an interrupted run is recognised whichever directory it is continued from).
    # Only the settings that apply are compared: those of other strategies and data kinds are not recorded.
    settings = with_absolute_paths(config.model_dump(mode="json", include=recorded(config)))
    run_dir, resuming = open_run_dir(out, settings, config.resume)
    if resuming and (run_dir / checkpoint_files.DIRECTORY).is_dir():
        epoch, notes = checkpoint_files.latest_complete(run_dir, world)
        if epoch is None and any(" is corrupt " in note for note in notes):
            note = notes[0].removesuffix("; starting the run over")
            raise UserError(f"run directory '{out}' has checkpoints but none is complete and readable ({note}); "
                            f"remove its {checkpoint_files.DIRECTORY}/ folder to start the run over")
        if epoch is not None:
            saved = checkpoint_files.manifest(run_dir, epoch, world)
            rules = registry.load("strategy rules", config.strategy)
            refused = resume_refusal(Path(out), epoch, saved, run_id(run_dir, create=False),
                                     fingerprint(data.train_set()) if data is not None else None,
                                     config.resume_with_changed_data, world, config.strategy,
                                     lambda within: rules.other_world_refused(config, within),
                                     _shard_size(config, world, saved))
            if refused:
                raise UserError(refused)
            first = checkpoint_files.load(run_dir, epoch, saved["members"][0])["model"]
            if saved.get("shard_size"):  # its first rank's shards, against the model (dptrain.train.reshard)
                where = f"the checkpoint of {checkpoint_files.describe(epoch)} in '{out}'"
                reshard.check_fits(model, first, saved["shard_size"], where)
            else:  # whole tensors, whether this run shards them or not (dptrain.train.reshard takes its rows)
                load_model_state(model, first, epoch, out)
    if resuming:
        keep_finished(run_dir, settings)
    paths = {key: settings[key] for key in ("data", "model", "loss")}
    text = to_yaml(config.model_copy(update={**paths, "out": str(run_dir), "resume": False, "workers": world}))
    saved_config = run_dir / "config.yaml"
    if not saved_config.exists() or saved_config.read_text() != text:
        write_text(saved_config, text)
    return run_dir, resuming


def _train(config: TrainConfig, prestarted: Optional[Ranks] = None) -> tuple[int, Union[Summary, Path]]:
    """Join the launcher's world, train alone, or spawn local workers: (exit code, Summary or run directory).

    `prestarted`: the local workers, started already by the caller (see `train`); else they are
    started here, before validation, and whoever started them closes them.
    """
    env = detect()
    if env.launched:
        return 0, run_worker(config, env)
    if config.nnodes > 1:  # one machine of several: its ranks meet the others' at --master
        return start_node(config)
    own = None
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        if config.workers > 1:
            # This process starts the workers and passes stop signals on to them once they have their work;
            # until then a stop signal stops them and it (one that came already, too).
            if prestarted is None:
                prestarted = own = prestart(config.workers, serve_store=config.min_workers is not None)
            stop_while_starting(take_early_stop_signal)
        model, data = _validate(config)
        if config.workers == 1:
            return 0, run_worker(config, env)
        return spawn_workers(config, model, prestarted, data)
    finally:
        if own is not None:
            own.close()
        if config.workers > 1:  # a caller's own handlers (train_from_config) are its own again
            for signum, handler in handlers.items():
                if handler is not None and threading.current_thread() is threading.main_thread():
                    signal.signal(signum, handler)


def start_node(config: TrainConfig) -> tuple[int, Path]:
    """This machine's --workers ranks of a job over --nnodes machines (dptrain.runtime.nodes), each started as
    `dptrain train` with the same settings; its rank 0 opens the run directory, as under torchrun."""
    from dptrain.runtime.nodes import launch_node, nodes_from

    nodes = nodes_from(config.nnodes, config.node_rank, config.master)
    _validate(config)  # the same data and model checks as one machine's, on each machine, before any rank starts
    argv = [sys.executable, "-m", "dptrain", "train", "--config", "-"]
    quiet_cpp_logs_of_children()
    text = to_yaml(config)
    with tempfile.TemporaryDirectory(prefix="dptrain-node-") as folder:
        settings = Path(folder) / "config.yaml"
        write_text(settings, text)
        argv[-1] = str(settings)
        code = launch_node(argv, config.workers, nodes, timeout=config.timeout,
                           grace=config.grace if config.grace is not None else config.timeout)
    return code, Path(config.out) if config.out else Path(".")  # (rank 0 printed the run's last line)


def train(config: TrainConfig, prestarted: Optional[Ranks] = None) -> int:
    """Entry point of `dptrain train`: its exit code. `prestarted`: its local workers, when `dptrain`
    started them before importing this module (and torch)."""
    return _train(config, prestarted)[0]


def train_from_config(config: Union[TrainConfig, dict]) -> Summary:
    """`dptrain train` from Python: the Summary of the run (raises what the workers reported, in one line).

    `config` is a TrainConfig or a dict of its keys. Outside a launcher this spawns
    `config.workers` processes on this machine; under torchrun, srun or mpirun it joins the job.
    """
    code, result = _train(config if isinstance(config, TrainConfig) else build_config(dict(config)))
    if isinstance(result, Summary):
        return result
    if code == Preempted.exit_code:
        raise Preempted(f"the workers stopped on a signal after a checkpoint in {result}; call again to continue")
    if code != 0:
        raise UserError(f"the workers of the run in '{result}' failed (exit code {code}); their output above says why")
    return Summary.from_dict(json.loads((result / "summary.json").read_text()))


def spawn_workers(config: TrainConfig, model: torch.nn.Module, prestarted: Optional[Ranks] = None,
                  data: Optional[DataSplits] = None) -> tuple[int, Path]:
    """Run `config.workers` local ranks (restarting up to --max-restarts times); (exit code, run directory).

    `prestarted`: the first attempt's ranks, already importing (dptrain.runtime.prestart).
    """
    out = config.out or default_run_dir(config.strategy)
    with lock_run_dir(out):  # the launcher holds the run directory while its workers run
        run_dir, resuming = prepare_run_dir(config, out, config.workers, model, data)
        verb = "continuing the run in" if resuming else "run directory"
        print(f"dptrain: {verb} {run_dir}; starting {config.workers} workers on this machine...", flush=True)
        argv = ["train", "--config", str(run_dir / "config.yaml")]
        quiet_cpp_logs_of_children()
        for attempt in range(config.max_restarts + 1):
            code = launch_local(config.workers, argv, config.timeout, prestarted if attempt == 0 else None,
                                may_lose=config.workers - kept_ranks(config) if config.min_workers else 0,
                                grace=config.grace if config.grace is not None else config.timeout, replacements=config.workers if config.replace_workers else 0,
                                join_file=run_dir / JOIN_FILE if config.min_workers else None,
                                unit=config.shard_size if config.shard == "hybrid" and config.min_workers else 1)
            if code == Interrupted.exit_code:  # Ctrl-C: the workers are stopped; say where the run stands
                print(f"dptrain: {describe_interruption(run_dir, config.workers, epochs_recorded(run_dir), config.epochs)}",
                      file=sys.stderr, flush=True)
            if code == 0:
                summary = Summary.from_dict(json.loads((run_dir / "summary.json").read_text()))
                print(summary_line(summary, run_dir), flush=True)
            if code in NOT_RESTARTED or attempt == config.max_restarts:
                return code, run_dir
            print(f"dptrain: restarting the {config.workers} workers from the last checkpoint "
                  f"(restart {attempt + 1} of {config.max_restarts})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last attempt returns")


def _join_run_dir(config: TrainConfig, env: DistEnv, ctx, held: ExitStack) -> TrainConfig:
    """Under an outside launcher rank 0 opens the run directory and tells the others (or its error).

    Rank 0 locks the directory into `held`, which the caller keeps open for the whole run.
    """
    decision: list = [None, None]
    if ctx.is_main:
        config = config.model_copy(update={"workers": ctx.world_size})
        out = config.out or default_run_dir(config.strategy, env.job_id or os.environ.get("TORCHELASTIC_RUN_ID"))
        try:
            held.enter_context(lock_run_dir(out))
            data = load_data(config, check_values=False, log=lambda message: None)
            run_dir, _ = prepare_run_dir(config, out, ctx.world_size, make_model(config, data), data)
            decision = [str(run_dir), None]
        except UserError as exc:
            decision = [None, str(exc)]
    decision = ctx.group.broadcast_object("opening the run directory", decision)
    if decision[1]:
        raise UserError(decision[1])
    return config.model_copy(update={"out": decision[0], "workers": ctx.world_size})


def run_worker(config: TrainConfig, env: DistEnv) -> Summary:
    """Train as one rank (or alone): the same code under every launcher."""
    if config.checkpoint_every or config.checkpoint_every_steps:
        catch_stop_signals_early()
    else:  # nothing to stop cleanly with: a stop signal stops the process
        release_early_stop_signals()
    set_cpu_threads()
    ctx = init_process_group(env, device=config.device, timeout=config.timeout)
    name_process(ctx, config)
    held = ExitStack()  # the run directory's lock, when this rank holds it
    try:
        return train_in_group(config, env, ctx, held)
    except UserError as exc:  # the peers end with its code and without a line of their own
        report_error(exc.exit_code)
        raise
    finally:
        destroy_process_group()
        held.close()


def name_process(ctx, config: TrainConfig) -> None:
    """The rank in this worker's process title, as `ps` and `top` show it ("dptrain train rank 1/4 sync runs/x"),
    where every worker was `python -m dptrain` before (setproctitle: a well-kept library for it). The title takes
    the room of the command line only (SPT_NOENV), so that /proc/PID/environ still shows the rank's environment
    (monitoring tools and `ps e` read it there); a long output directory is cut short in the title."""
    os.environ.setdefault("SPT_NOENV", "1")  # read when setproctitle is imported
    try:
        from setproctitle import setproctitle
    except ImportError:  # an environment without it: the title stays the interpreter's
        return
    rank = ctx.rank if ctx.joining is None else ctx.joining
    setproctitle(f"dptrain train rank {rank}/{ctx.world_size} {config.strategy}{' ' + config.out if config.out else ''}")
    try:  # setproctitle also names the process (comm) after the title's first 15 bytes; with spaces in it,
        # tools that split /proc/PID/stat on spaces (SLURM's proctrack/linuxproc) lose the process and its signals
        with open("/proc/self/comm", "w") as comm:
            comm.write("dptrain")
    except OSError:
        pass


def _goes_on_without_a_rank(env: DistEnv) -> bool:
    """Whether the launcher keeps the other ranks running when one fails (--min-workers): dptrain's own, srun
    (the job script's --kill-on-bad-exit=0), Open MPI's mpirun with --enable-recovery (4.x says so to its
    ranks) around a store that rank 0 does not serve."""
    if env.launcher in ("local", "srun"):
        return True
    return (env.launcher == "mpirun" and os.environ.get("OMPI_MCA_orte_enable_recovery") == "1"
            and store_served())


def _check_replacing(ctx, launcher: str, shard: str = "none") -> None:
    """--replace-workers under `launcher` (srun, mpirun): the store service must be the one starting the new
    workers, one per lost rank: of a sharded run (a lost replica group replaced whole) it is refused."""
    from dptrain.runtime import signed
    from dptrain.runtime.store_keys import REPLACING

    if shard != "none":
        raise UserError(f"--replace-workers with --shard {shard} under {launcher} is refused: the store service starts "
                        "one worker per lost rank, and a lost replica group is replaced whole by dptrain's own "
                        "launcher only (dptrain train --workers N); drop --replace-workers (the other groups still go "
                        "on)")

    store = ctx.group.store
    if store is None or not signed.present(store, REPLACING):
        raise UserError(f"--replace-workers under {launcher} needs the job's store served by `dptrain serve-store "
                        "--replace N`, which starts the new workers, as the job scripts of dptrain launch --scheduler "
                        "slurm and pbs do; launch the job so, or drop --replace-workers (the others still go on)")


def _check_live_launcher(config: TrainConfig, env: DistEnv) -> None:
    """--min-workers only under a launcher that lets the others go on when a worker fails."""
    if config.min_workers is None or not env.launched or _goes_on_without_a_rank(env):
        return
    # torchrun's agent stops every rank when one fails; srun keeps them with --kill-on-bad-exit=0, Open MPI's
    # mpirun with --enable-recovery, as dptrain launch's job scripts run them with --min-workers.
    if env.launcher == "mpirun":
        raise UserError("--min-workers under mpirun needs mpirun --enable-recovery (else it stops every rank "
                        "when one fails) and the ranks' store served by dptrain serve-store (DPTRAIN_STORE_SERVED=1"
                        "), as the job script of dptrain launch --scheduler pbs does; or drop --min-workers")
    raise UserError(f"--min-workers needs dptrain's own launcher (dptrain train --workers N), srun or mpirun "
                    f"--enable-recovery, which let the others go on when a worker fails; under {env.launcher} "
                    f"drop it (--max-restarts restarts all)")


def train_in_group(config: TrainConfig, env: DistEnv, ctx, held: ExitStack) -> Summary:
    """One run on a process group already joined (`ctx`), which stays up afterwards: a process may train
    several runs in turn (benchmarks/robustness.py). `held` keeps rank 0's lock on the run directory."""
    _check_live_launcher(config, env)
    set_rank(ctx.rank, ctx.world_size)  # a factory of each client's own data loads this rank's (dptrain.data.private)
    if config.replace_workers and env.launched and env.launcher != "local":
        _check_replacing(ctx, env.launcher, config.shard)
    if env.launcher != "local":
        config = _join_run_dir(config, env, ctx, held)
    data = _rank_data(config, env, ctx)
    model = make_model(config, data)
    # A worker joining a running job is alone until it is admitted; it takes the LR of the peer it heals from,
    # and its LR guard is made for the job's world, as every worker's was.
    world = ctx.world_size if ctx.joining is None else env.world_size
    factor, _ = lr_policy.lr_scale(config, world)
    lr = config.lr * factor
    if ctx.is_main and ctx.joining is None:
        say_lr_and_batch(config, world, factor)
    optimizer = build_optimizer(config.optimizer, model.parameters(), lr=lr, momentum=config.momentum,
                                nesterov=config.nesterov, weight_decay=config.weight_decay)
    schedule = lr_policy.ConfigSchedule(config, world)
    trainer = Trainer(model, optimizer, build_loss(config, data), build_strategy(config),
                      batch_size=config.batch_size, accumulate=config.accumulate, schedule=schedule, amp=config.amp,
                      grad_clip=config.grad_clip, seed=config.seed, shuffle=config.shuffle,
                      device=config.device, timeout=config.timeout, out=config.out, progress=config.progress,
                      tensorboard=config.tensorboard, log_to=tuple(config.log_to.split(",")) if config.log_to else (),
                      loader_workers=loader_workers(config.loader_workers, ctx),
                      checkpoint_every=config.checkpoint_every, keep_checkpoints=config.keep_checkpoints,
                      checkpoint_every_steps=config.checkpoint_every_steps,
                      resume=True, stop_on_collapse=config.stop_on_collapse,
                      lr_scale=lr_policy.guarded_scale(config, world),
                      min_workers=config.min_workers, max_workers=config.max_workers,
                      commit_every_steps=config.commit_every_steps or 0,
                      resume_with_changed_data=config.resume_with_changed_data, monitor=config.monitor,
                      early_stop_patience=config.early_stop_patience, shard=config.shard,
                      shard_size=config.shard_size, shard_unit=config.shard_unit,
                      shard_precision=config.shard_precision, shard_offload=config.shard_offload,
                      shard_checkpoint=config.shard_checkpoint,
                      lr_rule=lambda world: lr_policy.lr_scale(config, world)[0])
    trainer.emulate_straggler(config.slow_workers().get(ctx.rank if ctx.joining is None else ctx.joining, 1.0))
    trainer.data_record = data_record(config, data)
    return trainer.fit(data.train_set(), data.test_set(), epochs=config.epochs)


def _rank_data(config: TrainConfig, env: DistEnv, ctx):
    """This rank's data. validate() checked it before spawning (or running alone); under other launchers rank 0
    does. Each client's own data (dptrain.data.private): the ranks agree on the model all of them need."""
    said_by_launcher = not env.launched or env.launcher == "local"
    data = load_data(config, check_values=not said_by_launcher and ctx.is_main,
                     log=print if ctx.is_main and not said_by_launcher else (lambda message: None))
    if getattr(data.train, "private", False):
        from dptrain.data.private import agree
        data = agree(ctx.group, data)
    return data


def say_lr_and_batch(config: TrainConfig, world: int, factor: float) -> None:
    """The lines at a run's start about its LR (scaled for the workers, or kept although a rule was asked for)
    and, with --accumulate, its global batch."""
    said = lr_policy.lr_line(config, world) if factor != 1 else lr_policy.lr_kept_line(config, world)
    if said:
        print(said, flush=True)
    if config.accumulate > 1:
        print(f"dptrain: one optimizer step every {config.accumulate} batches of {config.batch_size} (--accumulate "
              f"{config.accumulate}): a global batch of {config.batch_size} x {world} workers x {config.accumulate} = "
              f"{config.batch_size * world * config.accumulate} samples", flush=True)


def data_record(config: TrainConfig, data: DataSplits) -> dict:
    """What the run trained on, from the data itself (summary.json's `data`): its source (--data as config.yaml
    records it, or the built-in --dataset), task, per-sample input shape (channels first), classes and samples,
    and with --stage-to what this process's copy did (dptrain.data.staging; summarise gathers every node's)."""
    source = with_absolute_paths({"data": config.data})["data"] if config.data is not None else config.dataset
    record = {"source": source, "task": data.task,
              "input_shape": list(data.input_shape), "classes": data.num_classes,
              "train_samples": len(data.train_set()),
              "test_samples": len(data.test_set()) if data.test_set() is not None else 0}
    staging = getattr(data.train_set(), "staging", None)
    if staging is not None:  # --stage-to: the copy's figures, live, as they stand when summary.json is written
        record["staging"] = staging.record
    return record


def loader_workers(asked: Optional[int], ctx) -> int:
    """DataLoader processes per rank: as asked, else none on the CPU (the ranks already use every
    core) and up to 4 per GPU rank, to keep it fed."""
    if asked is not None:
        return asked
    if ctx.device.type != "cuda":
        return 0
    ranks_here = max(1, torch.cuda.device_count())
    return max(0, min(4, (os.cpu_count() or 1) // ranks_here - 1))
