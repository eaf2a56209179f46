"""async: workers never wait for each other; each merges its progress into a global model.

When a worker finishes an epoch (every `every` epochs) it sends `delta = local - base` (base:
the global model it last received) to a merge service beside rank 0, which applies
`global += delta / W` and answers with the new global; the worker continues from it at once.
If every worker merges once, in any order, the global model is the plain average of the
workers' models, as under `sync`, because the deltas add up commutatively.

`merge="ema"` instead applies the reference system's rule `global = (global + local) / 2`, in
which the first of W merges ends up weighted 2^-W (kept for comparison).

`merge="delayed-nesterov"`: server momentum on the merged deltas, the delayed Nesterov (DN) update
of Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling" (arXiv:2401.09135,
Algorithm 3), with its period N = W merges (one round's worth: each worker once, on average).
The service keeps a momentum buffer m and a round buffer A (both zero at the start) and a count k
of merges in the current round. With d the worker's delta, β = `server_momentum`, ε = `server_lr`:

    A += d;  k += 1
    if k == W:  m = β·m + A/W;  global += ε·(d/W + β·m);  A = 0;  k = 0     (the round's last merge)
    else:       global += ε·d/W                                             (plain delta, scaled)

Every merge moves the global model at once (no worker waits for a round to fill), but momentum
is updated and applied only once per W merges, on the round's mean delta: over a round the
global moves by ε·(A/W + β·m), exactly the Nesterov step torch.optim.SGD(nesterov=True) takes
on the pseudo-gradient -A/W, i.e. sync's `outer="nesterov"` (DiLoCo) step on the round's average.
Applying momentum at every merge instead would update the velocity W times per round, each time
from one worker's delta computed on an older global, and carry every stale delta forward; the
paper identifies momentum on stale updates as what makes naive asynchronous local SGD take more
steps than synchronous local SGD, and proposes DN to repair it.
With β = 0 and ε = 1 the rule is `delta` merge for merge. What still holds of commutativity:
the global at the end of a round depends only on the *sum* of that round's deltas, not on their
order; the states inside a round, and hence the bases the workers continue from, do depend on it.

Compression (`compression` fp16, bf16 or int8; delta-type merges only, `ema` sends whole
models): a worker encodes `delta + residual` with dptrain.strategies.compression, keeps what
rounding dropped as its residual (error feedback, saved in its checkpoints), and sends the
encoded bytes; the service decodes them and merges the float32 result. Rank 0's own delta goes
through the same encoding (it is not sent), so every worker's contribution is rounded alike. The
reply, the global model, stays float32: rounding it would put error into every worker's base
that no residual carries forward.

The service is a thread in rank 0's process. Remote workers talk to it over torch.distributed
point-to-point messages in a process group of its own; rank 0's worker calls it directly.
Merges are serialised by a lock, so none is lost. Only parameters and floating buffers are
merged; integer buffers (BatchNorm's batch counter) stay per worker.

Pre-emption without a barrier: a rank asked to stop tells the service, every reply carries
the stop request to the others at their next merge, and each rank checkpoints at its own
epoch end. A rank that is done (finished or stopped) says so; the service answers a finished
rank only when rank 0 concludes the run, with "finish" (adopt the final global model) or
"stop" (exit to be continued), so that no rank exits while rank 0 still hosts the store and
the service for the others.
"""

from __future__ import annotations

import copy
import threading
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from dptrain.errors import Preempted
from dptrain.runtime.distributed import DistContext, PeerFailure
from dptrain.strategies.base import Strategy
from dptrain.strategies.collectives import broadcast_module, module_state, unflatten_into
from dptrain.strategies.compression import COMPRESSIONS, ErrorFeedback, decode, payload_bytes
from dptrain.strategies.rules.asynchronous import AsyncRules

MERGES = ("delta", "ema", "delayed-nesterov")
DELTA_MERGES = ("delta", "delayed-nesterov")  # merges of a change (which can be compressed), not a model
# Message kinds (first header field) and tags (one per message role, so they never cross).
MERGE, VERSION, REFRESH, DONE = 1, 2, 3, 4
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY, TAG_GLOBAL = 11, 12, 13, 14
HEADER_SIZE = 4
# How rank 0 concludes the run for a rank that is done (the first field of the reply to DONE).
FINISH, STOP = 1, 2
# The service waits for requests without a deadline (see MergeService._receive_request).
SERVICE_GROUP_TIMEOUT = timedelta(days=7)


def flat_state(module: nn.Module) -> torch.Tensor:
    """Parameters and floating buffers as one float32 CPU vector (the merge payload)."""
    floating, _ = module_state(module)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in floating])


def load_flat_state(module: nn.Module, flat: torch.Tensor) -> None:
    """Load a flat global state into `module`. A BatchNorm's running variance merged from stale bases
    (global + (local - base) / W) can fall below 0, and the model then outputs NaN until later merges
    lift it (found by benchmarks/robustness.py): it is kept at 0 or above."""
    with torch.no_grad():
        unflatten_into(module_state(module)[0], flat)
        for layer in module.modules():
            if isinstance(layer, nn.modules.batchnorm._NormBase) and layer.running_var is not None:
                layer.running_var.clamp_(min=0)


class GlobalModel:
    """The global model and its version; merges are serialised and counted per worker."""

    def __init__(self, initial: torch.Tensor, workers: int, merge: str = "delta", server_momentum: float = 0.9,
                 server_lr: float = 1.0) -> None:
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, not {merge!r}")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be at least 0 and less than 1, not {server_momentum}")
        if server_lr <= 0:
            raise ValueError(f"server_lr must be greater than 0, not {server_lr}")
        self.state = initial.clone()
        self.workers, self.merge = workers, merge
        self.server_momentum, self.server_lr = server_momentum, server_lr
        # delayed-nesterov: momentum m, the round's summed deltas A and how many merges it holds (k)
        self.momentum = torch.zeros_like(self.state) if merge == "delayed-nesterov" else None
        self.round_sum = torch.zeros_like(self.state) if merge == "delayed-nesterov" else None
        self.round_merges = 0
        self.version = 0
        self.merges = [0] * workers
        self.max_staleness_seen = 0
        self.stop_requested = False  # some rank was asked to stop: everyone checkpoints and stops
        self.lock = threading.Lock()

    def apply(self, rank: int, payload: torch.Tensor, base_version: int) -> tuple[torch.Tensor, int, int]:
        """Merge one worker's payload (a delta, or its local model for ema); return (global, version, staleness)."""
        with self.lock:
            staleness = self.version - base_version
            if self.merge == "delta":
                self.state.add_(payload, alpha=1.0 / self.workers)
            elif self.merge == "ema":
                self.state.add_(payload).mul_(0.5)
            else:
                self._delayed_nesterov(payload)
            self.version += 1
            self.merges[rank] += 1
            self.max_staleness_seen = max(self.max_staleness_seen, staleness)
            return self.state.clone(), self.version, staleness

    def _delayed_nesterov(self, delta: torch.Tensor) -> None:
        """One merge of the delayed Nesterov rule (see the module docstring)."""
        beta, lr, workers = self.server_momentum, self.server_lr, self.workers
        self.round_sum.add_(delta)
        self.round_merges += 1
        if self.round_merges < workers:
            self.state.add_(delta, alpha=lr / workers)
            return
        self.momentum.mul_(beta).add_(self.round_sum, alpha=1.0 / workers)
        self.state.add_(delta, alpha=lr / workers).add_(self.momentum, alpha=lr * beta)
        self.round_sum.zero_()
        self.round_merges = 0

    def state_dict(self) -> dict:
        """Everything needed to continue merging exactly (the global, its version and the server momentum)."""
        with self.lock:
            state = {"state": self.state.clone(), "version": self.version, "merges": list(self.merges),
                     "max_staleness_seen": self.max_staleness_seen}
            if self.momentum is not None:
                state.update(momentum=self.momentum.clone(), round_sum=self.round_sum.clone(),
                             round_merges=self.round_merges)
            return state

    def load_state_dict(self, saved: dict) -> None:
        with self.lock:
            self.state.copy_(saved["state"])
            self.version = saved["version"]
            self.merges = list(saved["merges"])
            self.max_staleness_seen = saved["max_staleness_seen"]
            if self.momentum is not None:
                if "momentum" not in saved:
                    raise ValueError("the checkpoint has no server momentum: it was saved by a run with another merge")
                self.momentum.copy_(saved["momentum"])
                self.round_sum.copy_(saved["round_sum"])
                self.round_merges = saved["round_merges"]

    def snapshot(self, copy: bool = True) -> tuple[Optional[torch.Tensor], int]:
        """(a copy of the global state, its version); only the version when `copy` is False."""
        with self.lock:
            return (self.state.clone() if copy else None), self.version


class MergeService:
    """Rank 0's thread: answers remote workers' merge, version and refresh requests until all are done."""

    def __init__(self, model: GlobalModel, group, ctx: DistContext, compression: str = "none") -> None:
        self.model, self.group, self.ctx = model, group, ctx
        self.compression = compression
        self.pending = set(range(1, ctx.world_size))
        self.finished: list[int] = []  # ranks done with training that wait for rank 0's conclusion
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._serve, name="dptrain-merge-service", daemon=True)

    def start(self) -> "MergeService":
        self._thread.start()
        return self

    def _receive_request(self) -> torch.Tensor:
        # Blocks until some worker asks: the service group's timeout is effectively infinite,
        # since a worker may train for hours between merges. Liveness is judged from heartbeats
        # by join(), not by this wait.
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        self.group.recv(header, tag=TAG_REQUEST)  # from any worker
        return header

    def _serve(self) -> None:
        try:
            while self.pending:
                header = self._receive_request()
                kind, rank, base_version, stopping = (int(v) for v in header)
                if kind == DONE:
                    self.pending.discard(rank)
                    if stopping:  # it has checkpointed and leaves now; the others stop at their next merge
                        self.model.stop_requested = True
                        self._conclude_for(rank, STOP)
                    else:
                        self.finished.append(rank)
                    continue
                if kind == MERGE:
                    payload = self._receive_payload(rank)
                    state, version, staleness = self.model.apply(rank, payload, base_version)
                else:
                    state, version = self.model.snapshot(copy=kind == REFRESH)
                    staleness = version - base_version
                reply = torch.tensor([version, staleness, int(self.model.stop_requested), 0], dtype=torch.int64)
                self.group.send(reply, rank, TAG_REPLY)
                if kind in (MERGE, REFRESH):
                    self.group.send(state, rank, TAG_GLOBAL)
        except Exception as exc:  # noqa: BLE001 - reported by rank 0's training thread
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    def _receive_payload(self, rank: int) -> torch.Tensor:
        """A worker's merge payload as float32: received as is, or as encoded bytes and decoded."""
        numel = self.model.state.numel()
        if self.compression == "none":
            payload = torch.empty_like(self.model.state)
            self.group.recv(payload, rank, TAG_PAYLOAD)
            return payload
        encoded = torch.empty(payload_bytes(self.compression, numel), dtype=torch.uint8)
        self.group.recv(encoded, rank, TAG_PAYLOAD)
        return decode(self.compression, encoded, numel)

    def _conclude_for(self, rank: int, outcome: int) -> None:
        self.group.send(torch.tensor([outcome, 0, 0, 0], dtype=torch.int64), rank, TAG_REPLY)

    def conclude(self, outcome: int) -> None:
        """Answer every finished rank (after join): FINISH, or STOP when the run stops to be continued."""
        for rank in self.finished:
            self._conclude_for(rank, outcome)
        self.finished.clear()

    def join(self) -> None:
        """Wait until every remote worker is done; fail naming those whose heartbeat stopped."""
        while self._thread.is_alive():
            self._thread.join(timeout=1.0)
            if self.error or self.ctx.heartbeat is None:
                continue
            silent = self.ctx.heartbeat.stalled(sorted(self.pending), self.ctx.timeout)
            if silent:
                names = ", ".join(map(str, silent))
                raise PeerFailure(f"rank 0: rank{'s' if len(silent) > 1 else ''} {names} stopped responding for "
                                  f"{self.ctx.timeout:g} s before finishing (no heartbeat)")
        if self.error:
            raise PeerFailure(f"rank 0: the merge service failed: {self.error}")


class Async(AsyncRules, Strategy):
    """Barrier-free merging into a global model at epoch ends (every `every` epochs)."""

    name = "async"
    # Other ranks may still merge after rank 0's last epoch, so finish() has a newer global model.
    final_model_is_last_evaluated = False
    average_check = "alone"

    def __init__(self, every: int = 1, merge: str = "delta", max_staleness: Optional[int] = None,
                 server_momentum: float = 0.9, server_lr: float = 1.0, compression: str = "none") -> None:
        super().__init__()
        if every < 1:
            raise ValueError("every must be at least 1")
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, not {merge!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be at least 0")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if compression != "none" and merge not in DELTA_MERGES:
            raise ValueError(f"compression {compression} needs a merge of deltas ({' or '.join(DELTA_MERGES)}); "
                             f"merge {merge} sends whole models")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be at least 0 and less than 1, not {server_momentum}")
        if server_lr <= 0:
            raise ValueError(f"server_lr must be greater than 0, not {server_lr}")
        self.every, self.merge, self.max_staleness = every, merge, max_staleness
        self.server_momentum, self.server_lr, self.compression = server_momentum, server_lr, compression
        self.feedback = ErrorFeedback(compression)  # this worker's residual (error feedback)
        self.base: Optional[torch.Tensor] = None
        self.base_version = 0
        self.merges = 0
        self.refreshes = 0
        self.max_staleness_seen = 0
        self.global_model: Optional[GlobalModel] = None
        self.service: Optional[MergeService] = None
        self.group = None
        self._diverged = False
        self._stop_seen = False  # a reply said that some rank was asked to stop
        self._final: Optional[dict] = None

    @classmethod
    def from_config(cls, config) -> "Async":
        return cls(every=config.sync_every, merge=config.merge, max_staleness=config.max_staleness,
                   server_momentum=config.server_momentum, server_lr=config.server_lr, compression=config.compression)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model, group=self.ctx.group)
            self.group = ctx.group.subgroup(range(ctx.world_size), backend="gloo",
                                            timeout=SERVICE_GROUP_TIMEOUT.total_seconds(), name="the merge service")
        self.base = flat_state(model)
        if ctx.rank == 0:
            self.global_model = GlobalModel(self.base, ctx.world_size, self.merge, self.server_momentum,
                                            self.server_lr)
            if ctx.world_size > 1:
                self.service = MergeService(self.global_model, self.group, ctx, self.compression).start()
        return model

    # -- talking to the service ----------------------------------------------------------------
    def _request(self, kind: int, payload: Optional[torch.Tensor] = None,
                 stopping: bool = False) -> tuple[Optional[torch.Tensor], int, int]:
        """One exchange with the service: returns (global state or None, version, staleness);
        for DONE, (None, the outcome rank 0 concluded, 0)."""
        if self.ctx.rank == 0:  # the service lives in this process
            if kind == MERGE:
                if self.compression != "none":  # rounded as a remote worker's would be, but not sent
                    payload = decode(self.compression, payload, self.global_model.state.numel())
                return self.global_model.apply(0, payload, self.base_version)
            state, version = self.global_model.snapshot(copy=kind == REFRESH)
            return state, version, version - self.base_version
        header = torch.tensor([kind, self.ctx.rank, self.base_version, int(stopping)], dtype=torch.int64)
        self._exchange(self.group.isend, header, TAG_REQUEST)
        if kind == MERGE:
            self._exchange(self.group.isend, payload, TAG_PAYLOAD)
        reply = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        self._exchange(self.group.irecv, reply, TAG_REPLY)
        if kind == DONE:
            return None, int(reply[0]), 0
        self._stop_seen = self._stop_seen or bool(reply[2])
        state = None
        if kind in (MERGE, REFRESH):
            state = torch.empty_like(self.base)
            self._exchange(self.group.irecv, state, TAG_GLOBAL)
        return state, int(reply[0]), int(reply[1])

    def _exchange(self, operation, tensor: torch.Tensor, tag: int) -> None:
        """One point-to-point message with rank 0, bounded by the run's timeout; counted both ways."""
        work = operation(tensor, 0, tag)
        try:
            work.wait(timeout=timedelta(seconds=self.ctx.timeout))
        except RuntimeError as exc:
            raise PeerFailure(f"rank {self.ctx.rank}: no answer from the merge service on rank 0 within "
                              f"{self.ctx.timeout:g} s: {str(exc).splitlines()[0]}") from None
        self.comm_bytes += tensor.numel() * tensor.element_size()

    def merge_now(self) -> int:
        """Send this worker's progress, continue from the new global; returns the staleness of the merge."""
        local = flat_state(self.model)
        if self.merge not in DELTA_MERGES:
            payload = local
        elif self.compression == "none":
            payload = local - self.base
        else:  # encoded bytes of delta + residual; the residual keeps what they drop
            payload = self.feedback.encode(local - self.base)
        state, version, staleness = self._request(MERGE, payload)
        load_flat_state(self.model, state)
        self.base, self.base_version = state, version
        self.merges += 1
        self.max_staleness_seen = max(self.max_staleness_seen, staleness)
        self._diverged = False
        return staleness

    def _refresh_if_stale(self) -> None:
        _, version, staleness = self._request(VERSION)
        if staleness <= self.max_staleness:
            return
        # Rebase: keep this worker's progress since its base, on top of the newer global.
        state, version, _ = self._request(REFRESH)
        local = flat_state(self.model)
        load_flat_state(self.model, state + (local - self.base))
        self.base, self.base_version = state, version
        self.refreshes += 1

    # -- hooks ---------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        self._diverged = True
        if self.max_staleness is not None and self.ctx.world_size > 1:
            self._refresh_if_stale()

    def end_epoch(self, epoch: int) -> bool:
        if (epoch + 1) % self.every == 0 and self._diverged:
            self.merge_now()
        return True  # a global model always exists: rank 0 evaluates it

    def averaging_events(self) -> int:
        return self.merges

    def evaluation_target(self) -> tuple[Optional[nn.Module], bool]:
        """Rank 0 evaluates a copy holding the current global model, alone: no one waits for it."""
        if self.global_model is None:
            return None, False
        snapshot = copy.deepcopy(self.model)
        load_flat_state(snapshot, self.global_model.snapshot()[0])
        return snapshot, False

    def finish(self) -> nn.Module:
        """Last merge, then the one barrier of the run: everyone adopts the final global model.

        If some rank stopped to be continued meanwhile, there is no final model: Preempted,
        after this rank's last checkpoint, as for a signal of its own."""
        if self._diverged:
            self.merge_now()
        if self.ctx.world_size > 1:
            if self.ctx.rank == 0:
                self.service.join()
                outcome = STOP if self.global_model.stop_requested else FINISH
                self.service.conclude(outcome)
                load_flat_state(self.model, self.global_model.snapshot()[0])
            else:
                _, outcome, _ = self._request(DONE)
            if outcome == STOP:
                raise Preempted(f"rank {self.ctx.rank}: another rank stopped the run before it finished; "
                                "run the same command again to continue")
            self.comm_bytes += broadcast_module(self.model, group=self.ctx.group)
            counts = self.ctx.group.gather_objects("summary", (self.merges, self.refreshes, self.max_staleness_seen))
        else:
            load_flat_state(self.model, self.global_model.snapshot()[0])
            counts = [(self.merges, self.refreshes, self.max_staleness_seen)]
        self._final = {"merges": [c[0] for c in counts], "refreshes": [c[1] for c in counts],
                       "max_staleness_seen": max(c[2] for c in counts)}
        return self.model

    # -- agreement without a barrier ------------------------------------------------------------
    def gather_stats(self, stats):
        """Only this rank's numbers live (nobody waits); workers_history gathers everyone's at the end."""
        return [stats]

    def agree_stop(self, requested: Optional[str]) -> Optional[str]:
        """This rank's own signal, or another rank's as the service last reported it."""
        if requested and self.global_model is not None:
            self.global_model.stop_requested = True
        others = self.global_model.stop_requested if self.global_model is not None else self._stop_seen
        return requested or ("a signal to another rank" if others else None)

    def stop_together(self) -> None:
        """Rank 0 keeps the store and the service up until every other rank is done, then stops them all."""
        if self.ctx.world_size == 1:
            return
        if self.ctx.rank == 0:
            self.service.join()
            self.service.conclude(STOP)
        else:
            self._request(DONE, stopping=True)

    def workers_history(self, history: list[dict]) -> Optional[dict[int, list[dict]]]:
        """Every worker's numbers of each epoch, gathered once at the end (live records hold only this rank's)."""
        if self.ctx.world_size == 1:
            return None
        mine = {record["epoch"]: record["workers"][0] for record in history}
        gathered = self.ctx.group.gather_objects("metrics", mine)
        return {record["epoch"]: [theirs[record["epoch"]] for theirs in gathered if record["epoch"] in theirs]
                for record in history}

    def state_dict(self) -> dict:
        # Async checkpoints are approximate: each rank saves at its own epoch end, rank 0 the
        # global model as it stands then (merges arrive in a run-dependent order anyway).
        state = super().state_dict()
        state.update(base=self.base, base_version=self.base_version, merges=self.merges, refreshes=self.refreshes,
                     max_staleness_seen=self.max_staleness_seen, diverged=self._diverged)
        if self.compression != "none":
            state["feedback"] = self.feedback.state_dict()
        if self.global_model is not None:
            state["global"] = self.global_model.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.base, self.base_version = state["base"], state["base_version"]
        self.merges, self.refreshes = state["merges"], state["refreshes"]
        self.max_staleness_seen, self._diverged = state["max_staleness_seen"], state["diverged"]
        if self.compression != "none" and "feedback" in state:
            self.feedback.load_state_dict(state["feedback"])
        if self.global_model is not None and "global" in state:
            self.global_model.load_state_dict(state["global"])
        # A rank that resumes at a newer version than rank 0's saved global sees negative
        # staleness once; clamp it so the refresh rule stays meaningful.
        if self.global_model is not None:
            self.base_version = min(self.base_version, self.global_model.version)

    def summary(self) -> dict:
        return dict(self._final or {})

    def describe(self) -> dict:
        described = {"name": self.name, "every": self.every, "merge": self.merge, "max_staleness": self.max_staleness,
                     "compression": self.compression}
        if self.merge == "delayed-nesterov":
            described.update(server_momentum=self.server_momentum, server_lr=self.server_lr)
        return described
