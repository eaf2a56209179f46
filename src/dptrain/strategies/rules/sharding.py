"""Sharding's options and rules, without torch: how many ranks hold one replica, and what is refused with it.

Sharding is an axis, not a strategy: `--shard full` makes all ranks one replica group whose model is
sharded over them (FSDP2), `--shard hybrid` makes replica groups of `--shard-size` ranks each (the ranks of
one node by default), and the strategy runs across the groups (dptrain.strategies.sharded). The strategies
that can run across sharded replica groups, and the settings refused with sharding, are named here once,
for the command line (dptrain.config) and the Python API (dptrain.Trainer's `shard`) alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SHARD_MODES = ("none", "full", "hybrid")
SHARD_PRECISIONS = ("fp32", "bf16")  # bf16: parameters all-gathered and computed in bf16, gradients reduced in fp32
SHARDED_STRATEGIES = ("allreduce", "sync", "streaming", "fedavg", "async")  # the others are refused with --shard
AVERAGING_ACROSS = ("sync", "streaming", "fedavg", "async")  # across replica groups: --shard hybrid only (full makes one)
LIVE_SHARDED = ("allreduce", "sync")  # those that go on without a lost replica group (--shard hybrid --min-workers)
FULL_LIVE_REFUSED = ("--shard full is refused with --min-workers: its one replica group holds the only copy of each "
                     "shard, so a lost rank loses the model (no second copy is kept); give --shard hybrid --shard-size "
                     "S, where --min-workers counts replica groups")
DEFAULT_UNIT_SHARE = 0.05  # without --shard-unit: each child module holding at least this share of the parameters
REFUSED_LINE = ("--shard full/hybrid runs with --strategy allreduce, sync, streaming, fedavg or async (all but "
                "allreduce: hybrid only, --compression none; sync: no --allreduce-epochs); not with --amp fp16 or "
                "--nnodes; --min-workers with --shard hybrid and allreduce or sync only, counted in replica groups")
# sync's and fedavg's settings that sharding takes only at these values (the others are not built for shards yet)
AVERAGING_PLAIN = {"compression": "none", "allreduce_epochs": 0}


@dataclass
class ShardOptions:
    """How the model is held: `shard` none (every rank a whole replica), full (one replica sharded over all
    ranks) or hybrid (replica groups of `shard_size` ranks, default the ranks of one node); the units
    `fully_shard` wraps are the modules of class `shard_unit` (default: each child holding at least
    DEFAULT_UNIT_SHARE of the parameters). `shard_precision` bf16: FSDP2's MixedPrecisionPolicy (bf16
    parameters in the all-gathers and the forward and backward, gradients reduced in fp32, the sharded
    parameters and the optimizer kept in fp32); `shard_offload`: the shards, their gradients and the optimizer
    state in CPU memory, the step on the CPU (a GPU run); `shard_checkpoint`: each unit's activations recomputed
    in the backward instead of kept."""

    shard: str = "none"
    shard_size: Optional[int] = None
    shard_unit: Optional[str] = None
    shard_precision: str = "fp32"
    shard_offload: bool = False
    shard_checkpoint: bool = False

    def __post_init__(self) -> None:
        problem = options_problem(self.shard, self.shard_size, self.shard_unit) or extras_problem(
            self.shard, self.shard_precision, self.shard_offload, self.shard_checkpoint)
        if problem is not None:
            from dptrain.errors import UserValueError

            raise UserValueError(problem)

    @property
    def sharded(self) -> bool:
        return self.shard != "none"

    def size(self, world: int, ranks_per_node: int) -> int:
        """S, the ranks of one replica group, in a world of `world` ranks (UserError when it does not fit)."""
        size = world if self.shard == "full" else (self.shard_size or ranks_per_node)
        problem = size_problem(self.shard, size, world, given=self.shard_size is not None)
        if problem is not None:
            from dptrain.errors import UserError

            raise UserError(problem)
        return size


def options_problem(shard: str, size: Optional[int], unit: Optional[str]) -> Optional[str]:
    """Why these sharding settings cannot be, in one line, or None."""
    if shard not in SHARD_MODES:
        return f"--shard must be one of {', '.join(SHARD_MODES)}, not {shard!r}"
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
        return f"--shard-size must be a whole number of at least 2 (ranks per replica group), not {size!r}"
    if size is not None and shard != "hybrid":
        return f"--shard-size applies to --shard hybrid, not --shard {shard}"
    if unit is not None and shard == "none":
        return "--shard-unit applies to --shard full or hybrid, not --shard none"
    if unit is not None and (not isinstance(unit, str) or not unit.isidentifier()):
        return f"--shard-unit must name a module class such as Block, not {unit!r}"
    return None


def extras_problem(shard: str, precision: str, offload: bool, checkpoint: bool) -> Optional[str]:
    """Why the precision, offload and activation-checkpointing settings of sharding cannot be, or None."""
    if precision not in SHARD_PRECISIONS:
        return f"--shard-precision must be one of {', '.join(SHARD_PRECISIONS)}, not {precision!r}"
    given = [flag for flag, on in (("--shard-precision bf16", precision != "fp32"), ("--shard-offload", offload),
                                   ("--shard-checkpoint", checkpoint)) if on]
    if given and shard == "none":
        return f"{given[0]} applies to --shard full or hybrid, not --shard none"
    return None


def size_problem(shard: str, size: int, world: int, given: bool) -> Optional[str]:
    """Why replica groups of `size` ranks do not fit a world of `world` ranks, in one line, or None."""
    valid = [each for each in range(2, world + 1) if world % each == 0]
    what = f"--shard-size {size}" if given else f"--shard {shard} ({size} ranks per node)"
    if world < 2:
        return f"--shard {shard} needs at least 2 ranks to shard over, not {world}"
    if size < 2 or world % size:
        return (f"{what} does not divide the {world} ranks into replica groups; valid sizes: "
                f"{', '.join(map(str, valid))}")
    return None


def one_group_refused(shard: str, strategy: str, world: Optional[int]) -> str:
    """What is said when `shard` makes one replica group of all `world` ranks (None: not known yet) under
    `strategy`, which averages or merges across groups: before the ranks start (`sharding_refused`), else at setup."""
    said = f"--shard {shard} makes one replica group of all {'the' if world is None else world} ranks: {strategy} " \
           "has nothing to average across groups; "
    if world is None:
        return said + "give --shard hybrid with a --shard-size that makes 2 replica groups or more, or --shard none"
    valid = [str(size) for size in range(2, world // 2 + 1) if world % size == 0]
    if valid:
        return said + f"give --shard hybrid with --shard-size {' or '.join(valid)}"
    return said + "it needs 2 replica groups or more of at least 2 ranks each (4 ranks or more), or --shard none"


def averaging_refused(strategy: str, shard: str, settings: dict) -> Optional[str]:
    """What of sync's or fedavg's `settings` (option name -> value) sharding refuses, as the flag and its value,
    or None: the same words from the command line (`sharding_refused`) and from Python (the strategy's shard_as).
    (--shard full under them is one replica group: `one_group_refused` says it, where the ranks are known.)"""
    for key, plain in AVERAGING_PLAIN.items():
        if settings.get(key, plain) != plain:
            return f"--{key.replace('_', '-')} {settings[key]}"
    return None


def sharding_refused(config: Any) -> Optional[str]:
    """Why `config` (a TrainConfig) cannot shard as asked, in one line, or None."""
    shard = config.shard
    problem = options_problem(shard, config.shard_size, config.shard_unit) or extras_problem(
        shard, config.shard_precision, config.shard_offload, config.shard_checkpoint)
    if problem is not None or shard == "none":
        return problem
    # The ranks are known before spawning only when --workers is given (srun and torchrun set their own world).
    world = config.workers if "workers" in config.model_fields_set else None
    if config.strategy in AVERAGING_ACROSS and shard == "full":
        return one_group_refused(shard, config.strategy, world)
    refused = []
    if config.strategy not in SHARDED_STRATEGIES:
        refused.append(f"--strategy {config.strategy}")
    if config.strategy in ("sync", "fedavg"):
        why = averaging_refused(config.strategy, shard, {key: getattr(config, key, plain)
                                                         for key, plain in AVERAGING_PLAIN.items()})
        refused += [why] if why is not None else []
    elif getattr(config, "compression", "none") != "none":
        refused.append(f"--compression {config.compression}")
    if config.amp == "fp16":
        refused.append("--amp fp16")
    if config.nnodes > 1:
        refused.append("--nnodes")
    if config.shard_offload and config.device == "cpu":
        refused.append("--shard-offload on --device cpu (it moves the shards from a GPU to the CPU)")
    if refused:
        return f"--shard {shard} is refused with {refused[0]}: {REFUSED_LINE}"
    if config.min_workers is not None:
        return live_refused(config)
    # With --workers a size that does not fit is said before anything starts; otherwise at setup, on every rank.
    if world is None or config.shard_size is None:
        return None
    if (problem := size_problem(shard, config.shard_size, config.workers, True)) is not None:
        return problem
    if config.strategy in AVERAGING_ACROSS and config.shard_size == config.workers:  # (the default size, a node's
        return one_group_refused(shard, config.strategy, config.workers)  # ranks, is known only at setup)
    return None


def live_strategy_refused(shard: str, strategy: str) -> Optional[str]:
    """Why --min-workers cannot go on with --shard `shard` under `strategy` (its name), in one line, or None: the part
    of `live_refused` that the Python API checks too (dptrain.strategies.sharded_live.refuse_live)."""
    if shard == "full":
        return FULL_LIVE_REFUSED
    if strategy not in LIVE_SHARDED:
        return (f"--shard hybrid with --min-workers (counted in replica groups) is refused with --strategy {strategy} "
                "(allreduce or sync only)")
    return None


def live_refused(config: Any) -> Optional[str]:
    """Why --min-workers cannot go on as `config` (sharded) asks, in one line, or None. With --shard hybrid it counts
    replica groups: a lost rank loses its group's shards (no second copy), so the group leaves whole and the
    others go on (dptrain.strategies.sharded)."""
    refused = live_strategy_refused(config.shard, config.strategy)
    if refused is not None:
        return refused
    why = None
    if config.shard_size is None:
        why = "no --shard-size (it counts replica groups of --shard-size ranks: give it)"
    elif config.min_workers > config.workers // config.shard_size:
        groups = config.workers // config.shard_size
        why = (f"--min-workers {config.min_workers}, more than the {groups} replica groups of {config.shard_size} "
               f"ranks (use 1 to {groups})")
    elif config.strategy == "sync" and config.min_workers < 2:
        why = "--strategy sync and --min-workers 1 (one replica group left has nobody to average with: give 2 or more)"
    elif getattr(config, "commit_every_steps", None) or config.max_workers is not None:
        why = ("--commit-every-steps or --max-workers (a lost replica group's epoch is redone from its start, and a "
               "group joins only in place of a lost one: --replace-workers)")
    return None if why is None else f"--shard hybrid with --min-workers (counted in replica groups) is refused with {why}"


def kept_ranks(config: Any) -> int:
    """The ranks --min-workers keeps going: that many replica groups of --shard-size ranks with --shard hybrid."""
    return config.min_workers * (config.shard_size or 1 if config.shard == "hybrid" else 1)
