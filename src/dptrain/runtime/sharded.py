"""A model sharded with FSDP2 (`fully_shard`) over one of the run's groups, its collectives made at the seam.

Inside a replica group each rank keeps 1/S of every unit's parameters, gradients and optimizer state as
DTensor shards. FSDP's all-gathers (before a unit's forward and backward) and reduce-scatters (of its
gradients) are handed to the run's Group (`SeamAllGather`, `SeamReduceScatter`: FSDP2's custom
collectives), so they are counted there like every other collective. The mesh FSDP shards over is made
from the Group's own process group, so a group made over the store works too.

Across replica groups the strategy communicates on another Group (dptrain.strategies.sharded); a
gradient all-reduce across them (HSDP) is FSDP's all-reduce hook, handed the reduce-scatter's output
(`shard_model`'s `across`, an AcrossReduce: its group is made again when replica groups are lost, --min-workers).
Within one replica group FSDP2 averages in the reduce-scatter (ReduceOp.AVG), as a plain FSDP2 script does; with
HSDP the reductions are sums, divided once after both (FSDP's `set_force_sum_reduction_for_comms`, a divide factor
of all ranks that averaged), and so on a backend without an average op (gloo before torch 2.8).

What a checkpoint holds of a sharded model or optimizer is this rank's shards as plain tensors
(`LocalShards`, `LocalOptimizerShards`), so it is written and read as every dptrain checkpoint is
(torch.load with weights_only, checksums, a temporary name renamed); model.pt is the full state dict
gathered on rank 0 (`full_state`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from dptrain.errors import UserError
from dptrain.runtime.group import Group, PeerFailure, first_line

# FSDP2 is imported where a model is sharded, not with this module: every strategy imports it (`local`, `full_state`),
# and an unsharded run neither needs FSDP2's modules nor pays for importing them (nor for their private
# collectives module, `_seam_collectives`, on another torch release).
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: its local shard when it is a DTensor, else the tensor itself (sharing
    storage: writing into it writes into the parameter)."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor's; a plain tensor has none
    return to_local() if to_local is not None else tensor


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that fully_shard made FSDP modules (none with a torch without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_sharded(model: Optional[nn.Module]) -> bool:
    return model is not None and bool(_fsdp_modules(model))


def _failing_as_peer(group: Group, what: str, collective: Callable[[], Any]) -> Any:
    """`collective()`; a failure of its wait (gloo's "Connection closed by peer": a rank of the replica group is
    gone) as a PeerFailure naming it, which live membership goes on after, not a traceback from inside FSDP."""
    try:
        return collective()
    except PeerFailure:
        raise
    except (dist.DistError, RuntimeError) as exc:
        raise PeerFailure(f"rank {group.members[group.rank]}: {what} in its replica group (ranks "
                          f"{', '.join(map(str, group.members))}) failed: {first_line(exc)}") from None


@functools.cache
def _seam_collectives() -> tuple[type, type]:
    """FSDP2's custom all-gather and reduce-scatter, made at the seam: (SeamAllGather, SeamReduceScatter)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class SeamAllGather(DefaultAllGather):
        """FSDP's all-gather of a unit's shards, through the Group (which counts this rank's shard)."""

        def __init__(self, group: Group, count: Callable[[int], None]) -> None:
            self.group, self.count = group, count

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            work, sent = _failing_as_peer(self.group, "an all-gather of a unit's shards",
                                          lambda: self.group.all_gather_into(output_tensor, input_tensor,
                                                                             async_op=async_op))
            self.count(sent)
            return work

    class SeamReduceScatter(DefaultReduceScatter):
        """FSDP's reduce-scatter of a unit's gradients, through the Group (which counts the unsharded gradients)."""

        def __init__(self, group: Group, count: Callable[[int], None]) -> None:
            self.group, self.count = group, count

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            work, sent = _failing_as_peer(self.group, "a reduce-scatter of a unit's gradients",
                                          lambda: self.group.reduce_scatter_into(output_tensor, input_tensor, op,
                                                                                 async_op=async_op))
            self.count(sent)
            return work

    return SeamAllGather, SeamReduceScatter


def mesh_of(group: Group) -> "DeviceMesh":  # noqa: F821 - torch.distributed.device_mesh's, imported here
    """A 1-D DeviceMesh over `group`'s own process group (the default group's when it is the job's), on the rank's
    device (where the model is: a GPU under NCCL, or gloo with CUDA tensors)."""
    from torch.distributed.device_mesh import DeviceMesh

    handle = group.handle if group.handle is not None else dist.group.WORLD
    _known_to_torch(handle, group.rank, group.world_size, group.backend)
    return DeviceMesh.from_group(handle, group.device.type)


def _known_to_torch(handle: dist.ProcessGroup, rank: int, size: int, backend: str) -> None:
    """Make `handle` (a group made over the store, dptrain.runtime.group.process_group: not by dist.new_group)
    one DeviceMesh.from_group accepts. torch 2.13 asks of a mesh's group what only torch's own constructors
    record: its ranks in the default group (distributed_c10d.get_process_group_ranks reads _world.pg_group_ranks,
    a KeyError otherwise), this process's rank in the default group (DeviceMesh.__init__ and get_local_rank call
    get_rank(), which needs an initialized default group), and its name (DTensor's functional collectives resolve
    the group by name, _resolve_process_group). A replica group that joined a running run (replacement ranks) has
    no default group shared with anyone: it is given a one-rank default group of its own (a HashStore, nothing
    on the network), and `handle` is recorded with this process's default rank at its place `rank` and other
    distinct numbers at the other places (the mesh's numbers only place this rank in it; the collectives go
    through `handle`)."""
    from torch.distributed import distributed_c10d as c10d

    if handle is dist.group.WORLD or handle in c10d._world.pg_group_ranks:
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    me = dist.get_rank()
    others = iter(number for number in range(size + 1) if number != me)
    numbers = [me if place == rank else next(others) for place in range(size)]
    c10d._world.pg_group_ranks[handle] = {number: place for place, number in enumerate(numbers)}
    c10d._world.pg_map[handle] = (backend, c10d._get_default_store())
    c10d._world.pg_names[handle] = handle.group_name
    c10d._register_process_group(handle.group_name, handle)


def units_of(model: nn.Module, unit: Optional[str], share: float) -> list[nn.Module]:
    """The modules `fully_shard` wraps before the root: those of class `unit`, or else each child of the root
    (and each item of a child ModuleList, Sequential or ModuleDict, in turn) that holds at least `share` of
    the parameters. A class no module has is a UserError naming the classes there are."""
    if unit is not None:
        found = [module for module in model.modules() if type(module).__name__ == unit and module is not model]
        if not found:
            classes = sorted({type(module).__name__ for module in model.modules() if module is not model})
            raise UserError(f"--shard-unit {unit} names no module of the model; its module classes are: "
                            f"{', '.join(classes) or 'none (the model has no child modules)'}")
        return found
    total = sum(p.numel() for p in model.parameters())
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif total and sum(p.numel() for p in child.parameters()) >= share * total:
                chosen.append(child)

    visit(model)
    return chosen


def fsdp_settings(precision: str = "fp32", offload: bool = False) -> dict:
    """fully_shard's keywords for --shard-precision (bf16: MixedPrecisionPolicy, parameters in bf16 in the
    all-gathers and the compute, gradients reduced in fp32) and --shard-offload (CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    settings: dict = {}
    if precision == "bf16":
        settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        settings["offload_policy"] = CPUOffloadPolicy()
    return settings


class AcrossReduce:
    """FSDP's all-reduce hook between replica groups (HSDP): each reduce-scattered gradient shard summed over
    `group` (the ranks holding the same shard; None: one replica group left, nothing to add), counted by `count`.

    With `hold_failures` (live membership) a failed all-reduce is kept instead of raised inside the backward pass,
    and the backward's later ones are skipped: FSDP finishes its backward (each unit's gradients reduced inside the
    replica group, the parameters resharded), so the survivors of a lost replica group go on with FSDP as it was;
    `raise_failure` raises it after the backward. `group` is replaced when the replica groups are made again."""

    def __init__(self, group: Optional[Group], count: Callable[[int], None], hold_failures: bool = False) -> None:
        self.group, self.count, self.hold_failures = group, count, hold_failures
        self.failure: Optional[BaseException] = None

    def __call__(self, reduced: torch.Tensor) -> None:
        if self.group is None or self.failure is not None:
            return
        if not self.hold_failures:
            self.count(self.group.all_reduce(reduced))
            return
        try:
            self.count(self.group.all_reduce(reduced))
        except (dist.DistError, RuntimeError) as exc:  # a PeerFailure (QuietPeer) too: raised after the backward
            self.failure = exc

    def raise_failure(self) -> None:
        """Raise the all-reduce failure this backward kept (a PeerFailure naming it), once."""
        failure, self.failure = self.failure, None
        if failure is None:
            return
        if isinstance(failure, PeerFailure):
            raise failure
        raise PeerFailure(f"rank {self.group.members[self.group.rank]}: a gradient all-reduce across the replica "
                          f"groups failed: {first_line(failure)}") from None


def shard_model(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], inside: Group,
                count: Callable[[int], None], *, unit: Optional[str], share: float,
                across: Optional[AcrossReduce] = None, settings: Optional[dict] = None,
                recompute: bool = False) -> nn.Module:
    """Shard `model` in place over `inside` (each unit, then the root) and point `optimizer` (None for a model
    that is only evaluated) at the sharded parameters; every collective FSDP makes goes through `inside` (and
    `across`: the gradients' all-reduce between replica groups, HSDP), counted by `count`. The model must be
    the same on every rank of `inside` already (FSDP keeps each rank's own part of its own copy). `settings`:
    fully_shard's other keywords (`fsdp_settings`); `recompute`: each unit's activations recomputed in the
    backward (activation checkpointing, torch's composable `checkpoint`)."""
    from torch.distributed.fsdp import fully_shard

    if optimizer is not None and any(optimizer.state.values()):
        raise RuntimeError("the optimizer must be sharded before its first step")
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    mesh = mesh_of(inside)
    wrapped = units_of(model, unit, share)
    if recompute:
        from torch.distributed._composable import checkpoint

        for module in wrapped:
            checkpoint(module)
    for module in wrapped + [model]:  # the root's parameters kept after forward: its backward needs them first
        fully_shard(module, mesh=mesh, reshard_after_forward=module is not model, **(settings or {}))
    sharded = dict(model.named_parameters())
    for param_group in optimizer.param_groups if optimizer is not None else []:
        param_group["params"] = [sharded[names[id(parameter)]] for parameter in param_group["params"]]
    SeamAllGather, SeamReduceScatter = _seam_collectives()
    # FSDP2's own mean in the reduce-scatter, as plain FSDP2's, where nothing is added across replica groups (and
    # nothing will be: live membership may bring a second group back)
    alone = across is None or (across.group is None and not across.hold_failures)
    averaged = alone and _averages(inside)
    for module in _fsdp_modules(model):
        module.set_custom_all_gather(SeamAllGather(inside, count))
        module.set_custom_reduce_scatter(SeamReduceScatter(inside, count))
        if not averaged:
            module.set_force_sum_reduction_for_comms(True)
        if across is not None:
            module.set_all_reduce_hook(across)
    if not averaged:
        divide_gradients(model, inside.world_size * (across.group.world_size if across is not None and
                                                     across.group is not None else 1))
    return model


def _averages(group: Group) -> bool:
    """Whether `group`'s backend averages in a reduce-scatter (ReduceOp.AVG), which FSDP2 then uses with no division
    of its own, as a plain FSDP2 script does: NCCL's does, gloo's from torch 2.8 on (pytorch PR #149781, a sum then a
    division, as dptrain's own). Across replica groups (HSDP) the mean is over ranks of two groups, a factor FSDP2
    would hand gloo as PREMUL_SUM, which gloo lacks: there dptrain sums and divides once, after both."""
    backend = str(group.backend).lower()
    if backend == "nccl":
        return True
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    return backend == "gloo" and group.device.type == "cpu" and version >= (2, 8)  # (gloo's CUDA path: untried)


def divide_gradients(model: nn.Module, ranks: int) -> None:
    """Each gradient of sharded `model` divided by `ranks` (all the ranks whose sums it holds) after its reductions:
    the mean over them (set again when the replica groups change)."""
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(float(ranks))


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Within it, a sharded `model` is whole on every rank (all-gathered once, kept through its forwards), so
    that ranks may run different numbers of forwards (an evaluation's slices); a plain model is left as it is."""
    sharded = _fsdp_modules(model)
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)  # (as shard_model set it)


def full_state(model: nn.Module, wanted: Optional[bool] = None) -> dict:
    """`model`'s whole state_dict on the CPU where `wanted` (the rank that writes the results; None: rank 0 of the
    job), else {}. A sharded model's is gathered, one tensor at a time, in each replica group (every rank must call
    it then): the rank that writes may be in any group once a group was lost (--min-workers), not only rank 0's."""
    if not is_sharded(model):
        return {key: value.detach().cpu() for key, value in model.state_dict().items()} if wanted in (None, True) \
            else {}
    keep = dist.get_rank() == 0 if wanted is None else wanted
    state = {}
    for key, value in model.state_dict().items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor's all-gather
        if keep:
            state[key] = whole.detach().cpu()
    return state


def shard_bytes(model: nn.Module) -> int:
    """The bytes of this rank's shards of `model`'s parameters."""
    return sum(local(p).numel() * p.element_size() for p in model.parameters())


class LocalShards:
    """A sharded module's state as this rank's shards, plain tensors (what its checkpoint file holds)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict:
        return {key: local(value).detach().clone() for key, value in self.module.state_dict().items()}

    def load_state_dict(self, saved: dict) -> None:
        """This rank's shards back (the same world and units wrote them); a key or shape that does not fit
        is a RuntimeError naming it (as load_state_dict's)."""
        current = self.module.state_dict()
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        if missing or unexpected:
            raise RuntimeError(f"Missing key(s) in state_dict: {missing[:3]}; Unexpected key(s): {unexpected[:3]}")
        with torch.no_grad():
            for key, value in current.items():
                part = local(value)
                if tuple(part.shape) != tuple(saved[key].shape):
                    raise RuntimeError(f"size mismatch for {key}: the checkpoint's shard has shape "
                                       f"{tuple(saved[key].shape)}, this rank's {tuple(part.shape)} (written with "
                                       f"another shard size, by a run that did not record it?)")
                part.copy_(saved[key])


def state_holder(model: nn.Module):
    """What holds `model`'s state as plain tensors: the module itself, or its shards (`LocalShards`) when sharded."""
    return LocalShards(model) if is_sharded(model) else model


class LocalOptimizerShards:
    """A sharded model's optimizer state as this rank's shards, plain tensors; loaded back as DTensors
    placed as the parameters they belong to."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        saved = self.optimizer.state_dict()
        state = {index: {key: (local(value).detach().clone() if isinstance(value, torch.Tensor) else value)
                         for key, value in entry.items()} for index, entry in saved["state"].items()}
        return {"state": state, "param_groups": saved["param_groups"]}

    def load_state_dict(self, saved: dict) -> None:
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {}
        for index, entry in saved["state"].items():
            parameter = parameters[int(index)]
            state[index] = {key: self._placed(value, parameter) for key, value in entry.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    @staticmethod
    def _placed(value: Any, parameter: torch.Tensor) -> Any:
        """A saved shard as the DTensor it was, where it is a shard of `parameter` (a momentum, Adam's moments);
        a number or a step count as it is."""
        from torch.distributed.tensor import DTensor

        if not isinstance(parameter, DTensor) or not isinstance(value, torch.Tensor) \
                or tuple(value.shape) != tuple(parameter.to_local().shape) or value.dim() == 0:
            return value
        return DTensor.from_local(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                                  shape=parameter.shape, stride=parameter.stride(), run_check=False)
