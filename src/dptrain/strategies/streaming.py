"""streaming: weight averaging overlapped with training, so a worker does not wait for the link.

Like `sync`, workers train alone and average their weights once a period; unlike `sync`, the
average travels while they keep training, and the local progress made meanwhile is kept on top
of it (the delay correction of "eager updates" for overlapped DiLoCo; the torchft streaming DiLoCo
code we read instead restores a fragment to its last global value before applying the average,
dropping those steps):

Period and overlap. A period is `every_steps` = K steps (local SGD), or `every` epochs (K = every
x steps per epoch). The overlap is D steps (`overlap_steps`, default ceil(K/2)): at step t_s a
worker snapshots its weights w_s, hands `w_s - g` (its change since the last global model g, the
same on every rank) to a non-blocking all-reduce and keeps training; D steps later, at t_s + D,
it waits for the sum and applies

    g <- g + mean_ranks(w_s - g)           = mean_ranks(w_s)        (the new global model)
    w <- g + (w_now - w_s)                                           (the delay correction)

so the D steps it took while the average was on the way are not thrown away. With D = 0 the
send and the wait are the same step and this is exactly `sync`'s local SGD (`--sync-every-steps
K`) or epoch averaging (`--sync-every E`). Why ceil(K/2) by default: the wait never blocks
while the transfer takes less than the compute of half a period, and the average a worker
applies is at most half a period old; D = K would hide transfers up to a whole period but apply
averages a whole period old, D = 1 hides only one step's compute.

When. With `every_steps`, the send is at every step t with t % K == 0 (t counts steps from 1
over the whole run, as `sync` does) and the wait at t + D (D <= K; the wait comes before a send
at the same step). With `every`, the average lands at the end of every E-th epoch: the send is
D steps before that epoch's last step (D is at most K - 1 there) and the wait is at the epoch end.

Epoch ends drain. A collective never stays in flight across an epoch end: `end_epoch` waits for
any average still travelling and applies it (early, with the correction for the steps taken so
far) before the trainer evaluates and checkpoints, so a checkpoint never holds a collective in
flight and a resumed run continues exactly (the global model g is part of the checkpoint); resumed on
another number of workers, each takes the replica of the writer at its place (one beyond their number a
copy of one) and g, the same in every writer's file, and the period is planned over the new world. The
price: a send within D steps of an epoch end is covered by fewer than D steps, one sent after an
epoch's last step by none (it is waited for at once).

Fragments. With `fragments` = F > 1 the model's tensors (parameters, then buffers, in module
order) are cut into F contiguous groups of roughly equal bytes, and each send carries one group,
in rotation: the j-th send of the run (j from 0) carries fragment j % F, so every tensor is
averaged once every F periods and a period sends about 1/F of the model.

Buffers. Floating buffers (BatchNorm statistics) travel with the parameters. Integer buffers take
the max of the snapshots plus the local change since (w <- max_ranks(w_s) + (w_now - w_s)), bool
buffers the OR of the snapshots OR the current value; both go in a second non-blocking all-reduce.

The end. `finish` drains and then, unless the replicas are already equal (D = 0, F = 1 and the
last step was an average), averages the whole model with one blocking all-reduce (integer
buffers: max), so every rank ends with the identical model.

What is evaluated. The global model g is the same on every rank; an epoch end after which g has
changed evaluates it (collectively). The replicas themselves differ by their local corrections.

`comm_bytes`: the initial broadcast of the model, the bytes of every flat tensor handed to an
all-reduce (one per dtype per send), and the final average. Optimizer state stays per worker.

Sharded replica groups (--shard hybrid, dptrain.strategies.sharded). The model is sharded inside each group of
S ranks and g alike (a second sharded module, no optimizer), so a rank holds 1/S of both. The fragments are cut
from the whole tensors before sharding (the same parameters on every rank, and as on an unsharded run); a send
carries this rank's shards of its fragment's tensors, all-reduced over the ranks holding the same shards in the
other groups (`across`), and the final average likewise: no average gathers a whole model. So a hybrid run of R
groups computes what an unsharded streaming run of R workers with S x the batch does, in float rounding. A
checkpoint holds this rank's shards of the replica, its optimizer and g.

Live membership (--min-workers). A lost worker's part of the epoch goes, with any average in flight: the
others go back to their state at that epoch's start (g included, the same on each) and redo it (`rebind`).

Every wait is bounded: `Group.wait` gives `Work.wait` the run's `--timeout` (with --min-workers it also gives
up on a member whose heartbeat stopped), and the trainer runs the hooks that wait (after_step, end_epoch,
finish) under the run's Group (runtime/group.py), which turns a failed or timed-out wait into one line naming
the silent rank.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from dptrain.data.sampler import EpochPlan
from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Strategy, check_period
from dptrain.runtime.group import Group
from dptrain.runtime.sharded import state_holder
from dptrain.strategies.collectives import average_module, broadcast_module, module_state, unflatten_into
from dptrain.strategies.rules.streaming import StreamingRules
from dptrain.strategies.sharded import Shardable


@dataclass
class _Send:
    """One dtype group of one send: the live tensors, their global copies, the buffer in flight."""

    kind: str  # "float" (mean of changes), "int" (max of snapshots), "bool" (or of snapshots)
    live: list[torch.Tensor]
    global_: list[torch.Tensor]
    flat: torch.Tensor  # handed to the all-reduce; holds the sum (or max) once waited for
    own: torch.Tensor  # what this rank sent (its change, or its snapshot)
    work: Optional[Any] = None  # the all-reduce in flight (torch.distributed's Work)


@dataclass
class _Pending:
    fragment: int
    sent_at: int  # the step after which the snapshot was taken
    wait_at: Optional[int]  # the step after which to wait (None: at the epoch end)
    sends: list[_Send] = field(default_factory=list)


def split_fragments(tensors: list[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indices of `tensors` cut into `fragments` contiguous, non-empty groups of roughly equal bytes:
    a group ends at the first tensor whose end reaches its share (k/F of all bytes) of the total."""
    if fragments > len(tensors):
        raise UserError(f"--fragments {fragments} is more than the model's {len(tensors)} tensors "
                        f"(parameters and buffers); use at most {len(tensors)}")
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    done, group = 0, 0
    for index, size in enumerate(sizes):
        later_groups = fragments - 1 - group
        if later_groups and groups[group] and (len(tensors) - index == later_groups
                                               or done >= total * (group + 1) / fragments):
            group += 1  # this group has reached its share (or each tensor left must start a group)
        groups[group].append(index)
        done += size
    return groups


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """`module`'s parameters (this rank's shards of a sharded one) and buffers, in module_state's order."""
    floating, integer = module_state(module)
    return floating + integer


def check_fragments(model: nn.Module, fragments: int) -> None:
    """Raise the UserError of split_fragments when `model` has fewer tensors than `fragments` (before workers start)."""
    floating, integer = module_state(model)
    split_fragments(floating + integer, fragments)


class Streaming(Shardable, StreamingRules, Strategy):
    """Weight averaging every K steps (or E epochs) overlapped with D steps of training, with the
    delay correction w <- mean(w_s) + (w_now - w_s); optionally one of F fragments per period. With a sharded
    model (`shard_as`), each rank averages its shards of a fragment with the ranks holding the same shards in
    the other replica groups, and g is held sharded as the model is (see "Sharded replica groups" above)."""

    name = "streaming"

    def __init__(self, every: int = 1, every_steps: Optional[int] = None, overlap_steps: Optional[int] = None,
                 fragments: int = 1) -> None:
        super().__init__()
        check_period(every, every_steps)
        if overlap_steps is not None and overlap_steps < 0:
            raise ValueError("overlap_steps must be at least 0")
        if every_steps is not None and overlap_steps is not None and overlap_steps > every_steps:
            raise ValueError(f"overlap_steps ({overlap_steps}) must be at most every_steps ({every_steps})")
        if fragments < 1:
            raise ValueError("fragments must be at least 1")
        self.every, self.every_steps = every, every_steps
        self.overlap_steps, self.fragments = overlap_steps, fragments
        self.averages = 0  # sends completed and applied
        self.waited_seconds = 0.0  # time spent blocked in Work.wait (what the overlap did not hide)
        self._steps_per_epoch: Optional[int] = None
        self._pending: Optional[_Pending] = None
        self._diverged = False  # replicas may differ
        self._global_changed = False  # g changed since the last epoch end
        self._global_model: Optional[nn.Module] = None
        self._groups: list[list[int]] = []
        self._joined_global: Optional[dict] = None  # a joiner's g from the peer it healed from, until `rebind`
        self._sends = 0  # sends started over the run (fragment = sends % F)
        self._step = 0  # the last step seen

    @classmethod
    def from_config(cls, config) -> "Streaming":
        return cls(every=config.sync_every, every_steps=config.sync_every_steps,
                   overlap_steps=config.overlap_steps, fragments=config.fragments)

    @classmethod
    def check_before_spawn(cls, config, model: nn.Module) -> None:
        """--fragments needs as many tensors as fragments (and --shard-unit a module of the model)."""
        check_fragments(model, config.fragments)
        super().check_before_spawn(config, model)

    # -- the schedule ----------------------------------------------------------------------------
    def epoch_plan(self, ctx: DistContext, n_samples: int, labels: Callable[[], np.ndarray], batch_size: int,
                   seed: int, shuffle: str, block_size: Optional[int] = None) -> EpochPlan:
        plan = super().epoch_plan(ctx, n_samples, labels, batch_size, seed, shuffle, block_size)
        self._steps_per_epoch = plan.steps
        return plan

    @property
    def period(self) -> int:
        """K: steps per period."""
        if self.every_steps is not None:
            return self.every_steps
        if self._steps_per_epoch is None:
            raise RuntimeError("with epoch periods the steps per epoch are known only after epoch_plan()")
        return self.every * self._steps_per_epoch

    @property
    def overlap(self) -> int:
        """D: steps between a send and its wait (ceil(K/2) by default; at most K - 1 with epoch periods)."""
        wanted = math.ceil(self.period / 2) if self.overlap_steps is None else self.overlap_steps
        return wanted if self.every_steps is not None else min(wanted, self.period - 1)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if self.shard_options is not None:
            return self._shard_setup_global(model, optimizer, ctx)
        if ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model, group=self.ctx.group)
            floating, integer = module_state(model)
            self._groups = split_fragments(floating + integer, self.fragments)
            self._global_model = copy.deepcopy(model)  # g: the last global model, equal on every rank
        return model

    def _shard_setup_global(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        """Shard the model inside its replica group, and g alike: each rank holds its part of both. The fragments
        are cut from the whole tensors, before sharding, so that a fragment is the same parameters on every rank
        (and on an unsharded run of the same model); each rank sends its shards of them."""
        self._groups = split_fragments(_tensors(model), self.fragments)
        global_model = copy.deepcopy(model)
        model = self._shard_setup(model, optimizer, ctx, average_gradients=False)  # rank 0's model, sharded
        self._global_model = self.replicas.shard_alike(global_model, self._add_bytes)
        self._copy_into_global(model)
        return model

    @property
    def _across(self) -> Group:
        """The ranks this rank averages with: all of them, or with a sharded model those holding its shards."""
        return self.replicas.across if self.replicas is not None else self.ctx.group

    def rebind(self, ctx: DistContext) -> nn.Module:
        """The average in flight (on the old group, from a state the run has gone back from) is dropped; g and
        the replicas are those of the epoch start the trainer set back, when g had not changed yet. Alone, a
        worker's own model is the run's (nothing to average with): g goes."""
        model = super().rebind(ctx)
        self._pending, self._global_changed = None, False
        if ctx.world_size == 1:
            self._global_model = None
        elif self._global_model is None:  # more than one again (a worker joined one left alone), or a joiner
            floating, integer = module_state(model)
            self._groups = split_fragments(floating + integer, self.fragments)
            self._global_model = copy.deepcopy(model)  # the replicas are equal: the joiner has rank 0's model
            if self._joined_global:
                self._global_model.load_state_dict(self._joined_global)
        self._joined_global = None
        return model

    def after_step(self, step: int) -> None:
        self._diverged, self._step = True, step
        if self.ctx.world_size == 1:
            return
        if self._pending is not None and self._pending.wait_at == step:
            self._complete(step)
        if self.every_steps is not None:
            if step % self.every_steps == 0:
                self._start(step, wait_at=step + self.overlap)
                if self.overlap == 0:
                    self._complete(step)
        elif self.overlap > 0 and (step + self.overlap) % self.period == 0:
            self._start(step, wait_at=None)  # lands at the end of the period's last epoch

    def end_epoch(self, epoch: int) -> bool:
        if self.ctx.world_size == 1:
            return True
        if self.every_steps is None and (epoch + 1) % self.every == 0 and self._pending is None:
            self._start(self._step, wait_at=None)  # D = 0: send and wait now
        if self._pending is not None:
            self._complete(self._step)  # drain: nothing in flight at an epoch end
        changed, self._global_changed = self._global_changed, False
        return changed

    def finish(self) -> nn.Module:
        assert self.model is not None and self.ctx is not None
        if self.ctx.world_size > 1:
            if self._pending is not None:
                self._complete(self._step)
            if self._diverged:
                self._final_average()
        return super().finish()

    def evaluation_target(self) -> "tuple[nn.Module | None, bool]":
        return (self._global_model if self._global_model is not None else self.model), True

    @property
    def final_model_is_last_evaluated(self) -> bool:  # type: ignore[override]
        """The last evaluated model is g; finish() returns g's value only when it needed no final average."""
        return not self._final_averaged

    _final_averaged = False

    # -- one send and its completion ---------------------------------------------------------------
    def _start(self, step: int, wait_at: Optional[int]) -> None:
        assert self._pending is None, "one average in flight at a time"
        fragment = self._sends % self.fragments
        self._sends += 1
        floating, integer = module_state(self.model)
        g_floating, g_integer = module_state(self._global_model)
        live_all, global_all = floating + integer, g_floating + g_integer
        chosen = self._groups[fragment]
        pending = _Pending(fragment, step, wait_at)
        by_kind: dict[tuple[str, torch.dtype], list[int]] = {}
        for index in chosen:
            tensor = live_all[index]
            kind = "float" if index < len(floating) else ("bool" if tensor.dtype == torch.bool else "int")
            by_kind.setdefault((kind, tensor.dtype), []).append(index)
        with torch.no_grad():
            for (kind, _), indices in by_kind.items():
                live = [live_all[i] for i in indices]
                global_ = [global_all[i] for i in indices]
                snapshot = torch.cat([t.detach().reshape(-1) for t in live])
                if kind == "float":
                    flat = snapshot - torch.cat([t.detach().reshape(-1) for t in global_])
                    op = "sum"
                else:
                    flat = snapshot.to(torch.uint8) if kind == "bool" else snapshot
                    op = "max"
                send = _Send(kind, live, global_, flat, flat.clone())
                if flat.numel():  # a rank may hold no shard of a fragment's tensors, nor then its peers across
                    send.work, sent = self._across.all_reduce_async(flat, op)
                    self.comm_bytes += sent
                pending.sends.append(send)
        self._pending = pending

    def _complete(self, step: int) -> None:
        """Wait for the average in flight and apply it: g <- mean(w_s), w <- g + (w_now - w_s)."""
        pending, self._pending = self._pending, None
        no_progress = step == pending.sent_at  # no step since the snapshot: the replica becomes g exactly
        waited = 0.0
        for send in pending.sends:
            begun = time.perf_counter()
            if send.work is not None:
                self._across.wait(send.work, "an average")
            waited += time.perf_counter() - begun
        self.waited_seconds += waited
        world = self._across.world_size
        with torch.no_grad():
            for send in pending.sends:
                if send.kind == "float":
                    mean_change = send.flat.div_(world)
                    offset = 0
                    for live, global_ in zip(send.live, send.global_):
                        count = live.numel()
                        change = mean_change[offset:offset + count].view_as(live)
                        global_.add_(change)
                        if no_progress:
                            live.copy_(global_)
                        else:  # w_now + (mean change - own change) = mean(w_s) + (w_now - w_s)
                            live.add_(change - send.own[offset:offset + count].view_as(live))
                        offset += count
                elif send.kind == "int":
                    unflatten_into(send.global_, send.flat)
                    offset = 0
                    for live in send.live:
                        count = live.numel()
                        live.add_(send.flat[offset:offset + count].view_as(live)
                                  - send.own[offset:offset + count].view_as(live))
                        offset += count
                else:  # bool: the OR of the snapshots, OR what this replica has set since
                    maxed = send.flat.bool()
                    unflatten_into(send.global_, maxed)
                    offset = 0
                    for live in send.live:
                        count = live.numel()
                        live.logical_or_(maxed[offset:offset + count].view_as(live))
                        offset += count
        self.averages += 1
        self._global_changed = True
        self._diverged = not (no_progress and self.fragments == 1)

    def _final_average(self) -> None:
        """One blocking average of the whole model; afterwards every replica (and g) is the same."""
        self.comm_bytes += average_module(self.model, self._across)
        self._copy_into_global(self.model)
        self._diverged = False
        self._final_averaged = True

    def _copy_into_global(self, model: nn.Module) -> None:
        """g <- `model`, tensor by tensor (each rank its own shards of a sharded model)."""
        with torch.no_grad():
            for global_, live in zip(_tensors(self._global_model), _tensors(model)):
                global_.copy_(live)

    # -- checkpoints and summaries ---------------------------------------------------------------
    def state_dict(self) -> dict:
        assert self._pending is None, "a checkpoint is taken at an epoch end, after end_epoch drained"
        state = super().state_dict()
        state.update(averages=self.averages, sends=self._sends, diverged=self._diverged,
                     waited_seconds=self.waited_seconds,
                     global_model={key: value.detach().clone() for key, value
                                   in state_holder(self._global_model).state_dict().items()}
                     if self._global_model is not None else {})
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.averages, self._sends, self._diverged = state["averages"], state["sends"], state["diverged"]
        self.waited_seconds = state["waited_seconds"]
        if self._global_model is not None and state["global_model"]:
            state_holder(self._global_model).load_state_dict(state["global_model"])
        elif self._global_model is not None:  # written by a worker alone, resumed on several: each copies its model
            state_holder(self._global_model).load_state_dict(state_holder(self.model).state_dict())
        elif state["global_model"]:  # a joiner, alone until `rebind` (dptrain.train.live): g for then
            self._joined_global = state["global_model"]

    def summary(self) -> dict:
        return {"averages": self.averages, "waited_seconds": self.waited_seconds}

    def describe(self) -> dict:
        return {"name": self.name, "every": self.every, "every_steps": self.every_steps,
                "overlap_steps": self.overlap_steps, "fragments": self.fragments, **self.sharding()}
