"""TrainConfig: the one validated description of a training run, from YAML, flags or Python.

Every field is a flag of `dptrain train` (`batch_size` -> `--batch-size`) and a key of
`--config run.yaml`; flags override the file. Validation errors become one sentence naming
the field, the bad value and what is valid (dptrain.errors.UserError).

The settings are declared in sections by concern (SECTIONS: data, model, optimizer, strategy, run,
membership), each a pydantic model; TrainConfig is all of them in one flat model, so that a setting is
`config.NAME`, a flat key of YAML and one flag, whatever its section. The strategy section is made of the
registered strategies' own options, each declared once in its rules (dptrain.strategies.rules), not here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from dptrain import lr_policy, registry
from dptrain.data.kinds import absolute_spec, data_help, data_options, find_source, readers_of
from dptrain.data.shard_patterns import looks_like_shards
from dptrain.errors import UserError, did_you_mean
from dptrain.user_code import FILE_SPEC, looks_like_spec
from dptrain.lr_policy import DEFAULT_LR_SCALING, LR_DEFAULTS
from dptrain.strategies.rules.outer import OUTER_LR_DEFAULTS
from dptrain.strategies.rules.sharding import sharding_refused

BUILTIN_LOSSES = ("auto", "cross-entropy", "mse")


def rules(strategy: str) -> Any:
    """The options and rules of a registered strategy (dptrain.strategies.rules.StrategyRules), without torch."""
    return registry.load("strategy rules", strategy)


class _Section(BaseModel):
    """A section of TrainConfig: some of its fields, by concern."""

    model_config = ConfigDict(extra="forbid")


class DataSection(_Section):
    """What to train on: the data set or your data, its task, how it is read and shuffled."""

    dataset: Optional[str] = Field("digits", description=f"built-in data set: {', '.join(registry.names('dataset'))}")
    data: Optional[str] = Field(None, description=data_help())  # each kind of source says what it takes
    task: Literal["auto", "classify", "regress"] = Field(
        "auto", description="auto: integer labels classify, float targets regress (said when it happens); "
                            "classify or regress overrides that")
    samples: Optional[int] = Field(None, ge=1, description="number of samples of a synthetic data set")
    image_size: Optional[int] = Field(None, ge=4, description="side of synthetic-images (32) or of an image "
                                                              "folder's images (default: the first image's size)")
    augment: bool = Field(False, description="image folders: random horizontal flips and crops of training images")
    channels: int = Field(3, ge=1, description="channels of synthetic-images")
    classes: int = Field(10, ge=2, description="classes of synthetic-images")
    features: int = Field(8, ge=1, description="inputs of synthetic-regression")
    block_size: Optional[int] = Field(None, ge=1, description="DSTensor block size (samples per block)")
    shuffle: Literal["global", "block", "local", "none"] = Field(
        "global", description="global: new permutation of all samples each epoch; block: new order of the data's "
                              "blocks and within each (reads files block by block); local: fixed shard per worker, "
                              "reshuffled within it; none")
    loader_workers: Optional[int] = Field(None, ge=0, description="DataLoader worker processes per rank; default 0 "
                                                                  "on the CPU, up to 4 per GPU rank")
    stage_to: Optional[str] = Field(None, description="shards: copy them to this node-local folder (e.g. $TMPDIR) "
                                                      "in the background, each read there once copied")


class ModelSection(_Section):
    """What to train: the model, its options, the loss."""

    model: str = Field("mlp", description=f"{', '.join(registry.names('model'))}, or package.module:factory")
    model_options: dict[str, Any] = Field(default_factory=dict, description="model options as KEY=VALUE (repeatable), e.g. depth=14")
    loss: str = Field("auto", description="auto (cross-entropy for classes, mse for regression), cross-entropy, "
                                          "mse, or package.module:function(output, target) returning the loss")

    @field_validator("loss")
    @classmethod
    def _loss_is_known_or_a_function(cls, value: str) -> str:
        if value not in BUILTIN_LOSSES and not looks_like_spec(value):
            raise ValueError(f"must be one of {', '.join(BUILTIN_LOSSES)} or package.module:function")
        return value


class OptimizerSection(_Section):
    """How each worker steps: batch, optimizer, learning rate and its schedule, scaling and warm-up
    (dptrain.lr_policy says what they mean)."""

    batch_size: int = Field(32, ge=1, description="samples per step and worker")
    accumulate: int = Field(1, ge=1, description="gradient accumulation: one optimizer step every N batches of "
                            "--batch-size, so the global batch is batch-size x workers x N (DDP communicates once "
                            "per step)")
    optimizer: Literal["sgd", "adam", "adamw"] = Field("sgd", description="sgd, adam or adamw")
    lr: Optional[float] = Field(None, gt=0, description="learning rate (default: 0.02 for sgd, 0.01 for adam and "
                                                         "adamw)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    nesterov: bool = Field(False, description="Nesterov momentum for SGD")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    lr_schedule: Literal["constant", "cosine", "step"] = Field("constant", description="constant, cosine or step")
    lr_step_epochs: int = Field(30, ge=1, description="step schedule: epochs between decays")
    lr_gamma: float = Field(0.1, gt=0, le=1, description="step schedule: decay factor")
    warmup_epochs: Optional[float] = Field(None, ge=0, description="linear LR warm-up length in epochs (fractions "
                                                                   "allowed; default 0, but when --lr-scaling auto "
                                                                   "scales the LR, a tenth of the epochs, at most 5)")
    lr_scaling: Literal["auto", "none", "linear", "sqrt"] = Field(
        DEFAULT_LR_SCALING, description="the LR for W workers: none (default) keeps --lr; linear (x W) and sqrt "
                                        "(x sqrt(W)) as asked; auto: x W with a warm-up where replicas train alone "
                                        "for whole epochs between averages (sync, async, fedavg over iid "
                                        "partitions), backed off towards --lr whenever an average goes wrong")
    scale_lr: bool = Field(False, description="short for --lr-scaling linear")
    grad_clip: Optional[float] = Field(None, gt=0, description="clip the gradient norm to this value")


class StrategyChoice(_Section):
    """Which strategy: the registry's names, read when validating (choices_of, _strategy_is_registered): a
    strategy registered after this module was imported is valid too."""

    strategy: str = Field(registry.DEFAULT_STRATEGY,
                          description=f"how workers synchronise: {registry.help_text('strategy')}")

    @field_validator("strategy")
    @classmethod
    def _strategy_is_registered(cls, value: str) -> str:
        if value not in registry.names("strategy"):
            raise ValueError(f"must be one of {', '.join(registry.names('strategy'))}")
        return value


def _strategy_options() -> dict[str, FieldInfo]:
    """The options of every strategy registered now, as their rules declare them ({name: field}, in the
    registry's order): each option is declared once, in the rules of the strategy that reads it, or in an
    option class of dptrain.strategies.rules that all strategies reading it inherit. Two different
    declarations of one name would make its flag mean one thing to one strategy and another to the next."""
    options: dict[str, FieldInfo] = {}
    declared_by: dict[str, str] = {}
    for strategy in registry.names("strategy"):
        for name, field in rules(strategy).Options.model_fields.items():
            if name not in options:
                options[name], declared_by[name] = field, strategy
            elif repr(field) != repr(options[name]):
                raise TypeError(f"strategies {declared_by[name]} and {strategy} declare option {name} differently; "
                                f"declare it once (an option class in dptrain.strategies.rules) and inherit it")
    return options


# The strategy section: the choice of strategy, then the options its rules declare. An option of a strategy
# registered later must be one of these (or a field of another section): TrainConfig holds no others.
StrategySection = create_model(  # type: ignore[call-overload]
    "StrategySection", __base__=StrategyChoice, __module__=__name__,
    __doc__="Which strategy and the options the registered strategies read (dptrain.strategies.rules).",
    **{name: (field.annotation, field) for name, field in _strategy_options().items()})


class RunSection(_Section):
    """How long and where: epochs, precision, seed, device, waits, checkpoints, resuming, outputs."""

    epochs: int = Field(10, ge=1, description="passes over the training data")
    amp: Literal["none", "bf16", "fp16"] = Field("none", description="autocast precision; fp16 needs a GPU")
    seed: int = Field(0, ge=0, description="seed for model initialisation and data order")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto uses cuda:LOCAL_RANK when GPUs exist")
    timeout: float = Field(300.0, gt=0, description="seconds any wait on another worker may take before failing")
    slow_worker: Optional[str] = Field(None, pattern=r"^\d+:\d+(\.\d+)?(,\d+:\d+(\.\d+)?)*$",
                                       description="straggler emulation RANK:FACTOR[,RANK:FACTOR]: that rank's steps take FACTOR "
                                                   "times its own compute, measured before training without "
                                                   "communication (never its waits for the others)")
    checkpoint_every: int = Field(1, ge=0, description="save a checkpoint every E epochs (0: never)")
    checkpoint_every_steps: int = Field(0, ge=0, description="also save a checkpoint every N training steps within "
                                                             "an epoch (0: never); a run killed or stopped "
                                                             "mid-epoch continues from there, bit for bit")
    keep_checkpoints: int = Field(2, ge=1, description="how many checkpoints to keep")
    resume: bool = Field(False, description="continue the run in --out from its last checkpoint (also automatic when "
                                            "--out holds an unfinished run with the same settings)")
    monitor: Optional[str] = Field(None, description="test_loss or test_accuracy: keep the best model by this test "
                                   "metric in OUT/best.pt (OUT/best.json says its epoch)")
    early_stop_patience: Optional[int] = Field(None, ge=1, description="stop after N evaluated epochs without a "
                                               "better --monitor value (test_loss unless --monitor says otherwise)")
    resume_with_changed_data: bool = Field(False, description="continue the run in --out although its training data "
                                                              "changed since its checkpoint (other rows, or other "
                                                              "rows held out); without it such a run is refused")
    out: Optional[str] = Field(None, description="run directory (default runs/STRATEGY-TIMESTAMP); must not hold a run already")
    stop_on_collapse: bool = Field(False, description="stop the run when averaging collapses (two averages in a "
                                                      "row clearly worse than the workers' own models); by default "
                                                      "it is said and recorded, and training goes on")
    progress: bool = Field(True, description="progress bar on rank 0 when the terminal is interactive")
    tensorboard: bool = Field(False, description="write TensorBoard events in OUT/tensorboard as each epoch ends "
                              "(tensorboard --logdir OUT/tensorboard); needs the tensorboard package. OUT/metrics.csv "
                              "is written always")
    log_to: Optional[str] = Field(None, description="also log each epoch's metrics to mlflow and/or wandb (comma-separated; "
                                  "the package must be installed), set up by their own variables (MLFLOW_TRACKING_URI, "
                                  "WANDB_PROJECT, WANDB_MODE=offline)")

    @field_validator("monitor")
    @classmethod
    def _monitor_is_a_test_metric(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in ("test_loss", "test_accuracy"):
            raise ValueError("must be test_loss or test_accuracy")
        return value

    @field_validator("log_to")
    @classmethod
    def _loggers_are_known(cls, value: Optional[str]) -> Optional[str]:
        names = value.split(",") if value else []
        if value is not None and (not names or any(n not in ("mlflow", "wandb") for n in names) or len(set(names)) < len(names)):
            raise ValueError("must be mlflow, wandb or both, comma-separated (mlflow,wandb)")
        return value


class MembershipSection(_Section):
    """Who trains: the workers, and what the launcher does when one fails or a new one joins (--min-workers
    and --commit-every-steps are options of the strategies that can go on without a lost worker)."""

    workers: int = Field(2, ge=1, description="worker processes to spawn on this machine (ignored under torchrun, srun, mpirun)")
    replace_workers: bool = Field(False, description="with --min-workers, local launcher: start a new worker in "
                                  "place of each one that fails; it joins the others at an epoch end, healed from "
                                  "a live one (--workers MIN:MAX is short for --workers MAX --min-workers MIN "
                                  "--replace-workers)")
    max_workers: Optional[int] = Field(None, ge=1, description="with --min-workers, local launcher: workers added "
                                       "by dptrain join enter while fewer than N train, so the run may grow beyond "
                                       "the --workers it started with (Horovod's --max-np; default: --workers)")
    max_restarts: int = Field(0, ge=0, description="local launcher: restart the workers from the last checkpoint up to N times")
    grace: Optional[float] = Field(None, gt=0, description="local launcher: seconds the workers have, after a stop "
                                   "signal passed on to them, to save and exit; those still running then are killed "
                                   "and named (default: --timeout; a frozen worker never exits by itself)")
    nnodes: int = Field(1, ge=1, description="machines that train together without a scheduler (torchrun's "
                        "--nnodes): run the same command on each, with its own --node-rank; --workers ranks on each")
    node_rank: int = Field(0, ge=0, description="with --nnodes: this machine's place, 0 to NNODES-1 (node 0 serves "
                           "the rendezvous at --master)")
    master: Optional[str] = Field(None, description="with --nnodes: HOST:PORT where node 0 serves the rendezvous "
                                  "(torchrun's --rdzv-endpoint): node 0's name or address and a free port")


class ShardingSection(_Section):
    """How each replica is held: whole on every rank, or sharded over the ranks of a replica group (FSDP2),
    the strategy running across the groups (dptrain.strategies.sharded; what is refused with it:
    dptrain.strategies.rules.sharding)."""

    shard: Literal["none", "full", "hybrid"] = Field(
        "none", description="none: every rank holds the whole model; full: one replica sharded over all ranks "
                            "(FSDP2); hybrid: replica groups of --shard-size ranks, each sharded, the strategy "
                            "(allreduce, sync, streaming, fedavg or async) across the groups")
    shard_size: Optional[int] = Field(None, ge=2, description="--shard hybrid: ranks per replica group (default: "
                                                              "the ranks of one node); must divide the ranks")
    shard_unit: Optional[str] = Field(None, description="--shard full/hybrid: the module class each unit is "
                                      "(e.g. Block); default: each child module holding at least 5 % of the "
                                      "parameters")
    shard_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="--shard full/hybrid: bf16 all-gathers the parameters and computes in bf16, reduces the "
                            "gradients in fp32 and keeps the shards and the optimizer in fp32 (FSDP2's "
                            "MixedPrecisionPolicy)")
    shard_offload: bool = Field(False, description="--shard full/hybrid on GPUs: the shards, their gradients and the "
                                "optimizer state in CPU memory, the optimizer step on the CPU")
    shard_checkpoint: bool = Field(False, description="--shard full/hybrid: recompute each unit's activations in "
                                   "the backward pass instead of keeping them (activation checkpointing)")


SECTIONS: dict[str, type[BaseModel]] = {"data": DataSection, "model": ModelSection, "optimizer": OptimizerSection,
                                        "strategy": StrategySection, "sharding": ShardingSection, "run": RunSection,
                                        "membership": MembershipSection}


class TrainConfig(MembershipSection, RunSection, ShardingSection, StrategySection, OptimizerSection,  # type: ignore[misc,valid-type]
                  ModelSection, DataSection):
    """All settings of one training run, flat: the sections of SECTIONS (fields in their order: data, model,
    optimizer, strategy, run, membership) in one model, with the checks across them. Field descriptions
    double as `--help` text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _workers_range(cls, values: Any) -> Any:
        """--workers MIN:MAX, torchrun's spelling: MAX workers that go on down to MIN, each lost one replaced."""
        text = values.get("workers") if isinstance(values, dict) else None
        if not isinstance(text, str) or ":" not in text:
            return values
        low, _, high = text.partition(":")
        try:
            smallest, largest = int(low), int(high)
        except ValueError:
            raise ValueError(f"workers {text!r} must be N or MIN:MAX, two whole numbers, e.g. 2:4") from None
        if not 1 <= smallest <= largest:
            raise ValueError(f"workers {text!r} must be MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4")
        if values.get("min_workers") is not None:
            raise ValueError(f"workers {text} sets min_workers {smallest} already; drop min_workers")
        if values.get("shard") not in (None, "none"):  # (where --min-workers counts replica groups, not ranks)
            raise ValueError(f"workers {text} counts ranks, and with --shard {values['shard']} --min-workers counts "
                             f"replica groups; give --workers {largest} --min-workers GROUPS --replace-workers")
        return {**values, "workers": largest, "min_workers": smallest, "replace_workers": True}

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "TrainConfig":
        if self.data is None and self.dataset is None:
            raise ValueError("give --dataset or --data")
        _refuse_what_does_not_apply(self)
        rules(self.strategy).check(self)
        if (refused := sharding_refused(self)) is not None:
            raise ValueError(refused)
        if self.scale_lr and self.lr_scaling != "linear":
            if "lr_scaling" in self.model_fields_set and self.lr_scaling != "auto":
                raise ValueError(f"scale_lr is short for lr_scaling linear and contradicts lr_scaling "
                                 f"{self.lr_scaling}; give one of them")
            self.lr_scaling = "linear"  # recorded so in config.yaml
        if self.outer_lr is None and OUTER_LR_DEFAULTS[self.outer] is not None:  # none has no outer LR
            self.outer_lr = OUTER_LR_DEFAULTS[self.outer]
        if self.lr is None:
            self.lr = LR_DEFAULTS[self.optimizer]
        if self.resume and not self.out:
            raise ValueError("resume needs out, the run directory to continue")
        if self.replace_workers and self.min_workers is None:
            raise ValueError("replace_workers needs min_workers: the others go on while a replacement starts "
                             "(or give workers MIN:MAX)")
        if self.max_workers is not None and self.min_workers is None:
            raise ValueError("max_workers needs min_workers: workers enter a run whose membership changes "
                             "(or give workers MIN:MAX)")
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(f"max_workers {self.max_workers} is fewer than workers {self.workers}, the workers "
                             f"the run starts with; give {self.workers} or more")
        for rank, factor in self.slow_workers().items():
            if factor < 1:
                raise ValueError(f"slow_worker factor {factor} for rank {rank} must be at least 1")
        self._nodes_check()
        return self

    def _nodes_check(self) -> None:
        """--nnodes, --node-rank and --master together (dptrain.runtime.nodes)."""
        if self.nnodes == 1:
            for key, default in (("node_rank", 0), ("master", None)):
                if getattr(self, key) != default:
                    raise ValueError(f"{key} applies to several machines (nnodes above 1), not nnodes 1")
            return
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be 0 to {self.nnodes - 1} with nnodes {self.nnodes}")
        if self.master is None:
            raise ValueError(f"nnodes {self.nnodes} needs master HOST:PORT, where node 0 serves the rendezvous "
                             "(the same on every machine)")
        from dptrain.runtime.nodes import parse_master

        try:
            parse_master(self.master, "master")
        except UserError as exc:
            raise ValueError(str(exc)) from None
        for key, given in (("min_workers", self.min_workers is not None), ("replace_workers", self.replace_workers),
                           ("max_restarts", self.max_restarts > 0)):
            if given:
                raise ValueError(f"{key} is not available across machines without a scheduler (nnodes "
                                 f"{self.nnodes}): each machine's launcher stops its ranks when one fails; start the "
                                 "same commands again to resume from the last checkpoint, or use a scheduler "
                                 "(dptrain launch --scheduler slurm or pbs)")

    def lr_scale(self, world: int) -> tuple[float, str]:
        """(factor the LR is multiplied by for `world` workers, the rule that gave it): dptrain.lr_policy.lr_scale."""
        return lr_policy.lr_scale(self, world)

    def auto_scales(self) -> bool:
        """Whether --lr-scaling auto raises this run's LR: dptrain.lr_policy.auto_scales."""
        return lr_policy.auto_scales(self)

    def warmup(self, world: int) -> float:
        """Epochs of linear LR warm-up for `world` workers: dptrain.lr_policy.warmup."""
        return lr_policy.warmup(self, world)

    def slow_workers(self) -> dict[int, float]:
        """--slow-worker as {rank: factor}."""
        if not self.slow_worker:
            return {}
        pairs = (item.split(":") for item in self.slow_worker.split(","))
        return {int(rank): float(factor) for rank, factor in pairs}

    def section(self, name: str) -> BaseModel:
        """The settings of section `name` (a key of SECTIONS) as that section's model."""
        section = SECTIONS[name]
        return section.model_validate({key: getattr(self, key) for key in section.model_fields})


FIELDS = TrainConfig.model_fields


def section_of(key: str) -> str:
    """The section (a key of SECTIONS) that declares setting `key`."""
    return next(name for name, section in SECTIONS.items() if key in section.model_fields)


def _strategy_readers() -> dict[str, list[str]]:
    """{option: the strategies that read it (their rules' Options)}, in the registry's order."""
    readers: dict[str, list[str]] = {}
    for name in registry.names("strategy"):
        for option in rules(name).option_names():
            readers.setdefault(option, []).append(name)
    return readers


def not_applying(config: TrainConfig) -> dict[str, tuple[str, str]]:
    """The settings that some strategy or kind of data reads and `config`'s do not: {key: (who reads it,
    what was chosen instead)}, in words. A --data path not on this machine (a job's, checked where it runs)
    is of no kind yet: then no data setting is among them."""
    refused: dict[str, tuple[str, str]] = {}
    chosen = set(rules(config.strategy).reads(config))
    for option, names in _strategy_readers().items():
        if option not in chosen:
            which = (f"strategy {names[0]}" if len(names) == 1
                     else f"strategies {', '.join(names[:-1])} and {names[-1]}")
            refused[option] = (which, config.strategy)
    data = config.data
    if data is None or looks_like_spec(data) or os.path.exists(data) or looks_like_shards(data, Path()):
        source = find_source(data)
        reads = source.reads(config)
        for option in data_options():
            if option not in reads:
                refused[option] = (readers_of(option), source.described(config))
    return refused


def _refuse_what_does_not_apply(config: TrainConfig) -> None:
    """The one rule for settings that do not apply: a setting given (a flag, a key of a config file that
    changes its default, a keyword from Python) that the chosen strategy or data does not read is an error
    naming it, what reads it and what was chosen. Defaults are never refused."""
    refused = not_applying(config)
    for option in FIELDS:
        if option in refused and option in config.model_fields_set and getattr(config, option) is not None:
            readers, chosen = refused[option]
            raise PydanticCustomError("does_not_apply", "{option} applies to {readers}, not {chosen}",
                                      {"option": option, "readers": readers, "chosen": chosen})


def flag_of(key: str) -> str:
    """The command-line flag of a config key: batch_size -> --batch-size."""
    return "--" + key.replace("_", "-")


# Aliases a YAML file may use for a key: the flag's own spelling where it differs from the key.
KEY_ALIASES = {"model_option": "model_options"}

# pydantic error types -> what the value must be ("--workers must be at least 1").
_RULES = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "dict_type": "must be a mapping of KEY: VALUE",
    "string_type": "must be text",
}
_PATTERNS = {"slow_worker": "must look like RANK:FACTOR[,RANK:FACTOR...], e.g. 1:3"}


def choices_of(name: str) -> Optional[tuple[str, ...]]:
    """The valid values of a choice field (a Literal, or the registry's strategies), else None."""
    if name == "strategy":
        return registry.names("strategy")
    annotation = FIELDS[name].annotation
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return tuple(args)
    return None


def _describe(error: dict, origin: str, flags: frozenset = frozenset()) -> str:
    """Turn one pydantic error into one sentence: what is wrong, where it came from, what is valid."""
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    field = loc[0] if loc else ""
    if error["type"] == "does_not_apply":  # the one rule for settings that do not apply (its ctx names them)
        ctx = error["ctx"]
        subject = flag_of(ctx["option"]) if ctx["option"] in flags else f"key '{ctx['option']}' in {origin}"
        return f"{subject} applies to {ctx['readers']}, not {ctx['chosen']}"
    if error["type"] == "extra_forbidden":
        hint = did_you_mean(field, list(FIELDS)) or f"valid keys are: {', '.join(FIELDS)}"
        return f"unknown key '{field}' in {origin}; {hint}"
    if not field:  # cross-field check
        return f"invalid settings in {origin}: {error['msg'].removeprefix('Value error, ')}"
    value = error.get("input")
    subject = flag_of(field) if field in flags else f"key '{field}' in {origin} ({flag_of(field)})"
    shown = str(value) if _is_number(value) else repr(value)  # a number as typed, words quoted
    if error["type"] == "literal_error":
        rule = f"must be one of {', '.join(choices_of(field) or ())}"
    elif error["type"] == "string_pattern_mismatch" and field in _PATTERNS:
        rule = _PATTERNS[field]
    elif error["type"] in _RULES:
        bounds = {key: f"{bound:g}" if isinstance(bound, float) else bound
                  for key, bound in error.get("ctx", {}).items()}
        rule = _RULES[error["type"]].format(**bounds)
    elif error["type"] == "value_error" and error["msg"].startswith("Value error, must "):
        rule = error["msg"].removeprefix("Value error, ")
    else:
        rule = "is invalid: " + error["msg"].removeprefix("Value error, ")
    return f"{subject} {rule} (got {shown})"


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return not isinstance(value, bool)
    except (TypeError, ValueError):
        return False


def build_config(values: dict[str, Any], origin: str = "the settings", flags: Iterable[str] = ()) -> TrainConfig:
    """Validate a mapping of settings; raise UserError with one sentence on the first problem.

    `flags` names the keys that came from the command line (their errors name the flag)."""
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise UserError(_describe(exc.errors()[0], origin, frozenset(flags))) from None


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 numbers: `slow_worker: 1:3` stays the text 1:3 (not 63)
    and `time: 1:30:00` the text 1:30:00 (not 5400), as YAML 1.2 reads them."""

    yaml_implicit_resolvers = {
        first: [(tag, re.compile("(?=[^:]*$)" + pattern.pattern, pattern.flags))
                if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") else (tag, pattern)
                for tag, pattern in resolvers]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def parse_yaml(text: Any) -> Any:
    """YAML text (or a stream) read with YamlLoader: plain data, nothing constructed, no base-60 numbers."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader


# What a run's config.yaml must be, for the line that says it is not.
RUN_SETTINGS = "dptrain writes it as one 'key: value' line per setting: repair it so"


def read_yaml(path: "str | os.PathLike[str]", what: str, fix: str) -> dict[str, Any]:
    """The mapping in the YAML file `path` (empty: {}), or UserError with one sentence: `what` the file is, the
    line and column of a syntax error and what the parser expected there, then `fix` (what would be valid)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = parse_yaml(handle)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{what} '{path}' is not valid YAML{where}: {problem}; {fix}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} '{path}' is not UTF-8 text (byte {exc.start}); {fix}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} '{path}': {exc.strerror or exc}; {fix}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} '{path}' must hold a mapping of keys to values, not a {type(data).__name__}; {fix}")
    return data


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file into a dict (keys may use '-' or '_')."""
    if not os.path.isfile(path):
        raise UserError(f"config file '{path}' does not exist")
    data = read_yaml(path, "config file", "give settings as 'key: value' lines, e.g. 'epochs: 10'")
    keys = {str(key).replace("-", "_"): value for key, value in data.items()}
    return {KEY_ALIASES.get(key, key): value for key, value in keys.items()}


def resolve(config_file: Optional[str], overrides: dict[str, Any]) -> TrainConfig:
    """Config file values, then command-line overrides on top, validated once."""
    values = load_yaml(config_file) if config_file else {}
    # A file's strategy or data option at its default is not given (a run's older config.yaml lists them all).
    optional = set(_strategy_readers()) | set(data_options())
    values = {key: value for key, value in values.items()
              if key not in optional or key not in FIELDS or value != _as_yaml(FIELDS[key].default)}
    given = {key: value for key, value in overrides.items() if value is not None}
    if {**values, **given}.get("outer", "none") == "none" and values.get("outer_lr") == OLD_OUTER_LR_OF_NONE:
        del values["outer_lr"]  # recorded by an older dptrain for outer none, which has no outer LR
    origin = f"'{config_file}'" if config_file else "the command line"
    return build_config({**values, **given}, origin, flags=given)


def with_absolute_paths(values: dict[str, Any], base: Optional[str] = None) -> dict[str, Any]:
    """`values` (TrainConfig keys) with --data as its kind records it (a file or folder that exists, the file
    of a `path/to/file.py:factory`: dptrain.data.kinds) and the file of a `path/to/file.py:factory` --model
    or --loss as absolute paths from `base` (default: the working directory), so that a config.yaml repeats
    its run from any directory. Built-in names and package.module:factory specs stay as they are."""
    base = base or os.getcwd()
    absolute = dict(values)
    for key in ("data", "model", "loss"):
        value = absolute.get(key)
        if not isinstance(value, str) or os.path.isabs(value):
            continue
        match = FILE_SPEC.match(value)
        if key == "data":
            absolute[key] = absolute_spec(value, base)
        elif match and not os.path.exists(os.path.join(base, value)):
            absolute[key] = f"{os.path.abspath(os.path.join(base, match['path']))}:{match['attribute']}"
    return absolute


# What dptrain recorded as outer_lr for outer none before none had no outer LR.
OLD_OUTER_LR_OF_NONE = 0.7


def _as_yaml(value: Any) -> Any:
    """`value` as YAML gives it back (tuples as lists)."""
    return parse_yaml(yaml.safe_dump(value)) if isinstance(value, tuple) else value


def recorded(config: TrainConfig) -> set[str]:
    """The settings that apply to `config` (all but those of other strategies and other kinds of data):
    what a run records and compares."""
    return set(FIELDS) - set(not_applying(config))


def to_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML that `--config` reads back to the same TrainConfig: the settings that
    apply to its strategy and data (the others would be refused, and hold their defaults)."""
    return yaml.safe_dump(config.model_dump(mode="json", include=recorded(config)), sort_keys=False)
