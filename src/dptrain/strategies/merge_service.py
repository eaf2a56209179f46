"""async's merge service and its wire protocol: the global model (GlobalModel) and rank 0's thread that merges
the other workers' progress into it (MergeService), with live membership's leaving out of lost workers.

A request is a header of int64 fields on TAG_REQUEST (its kind first: MERGE, VERSION, REFRESH or DONE), then a
MERGE's payload on TAG_PAYLOAD (flat_state's float32 vector, or its compressed bytes); the reply is a header on
TAG_REPLY, then the global model on TAG_GLOBAL for MERGE and REFRESH. The whole protocol, with stopping, live
membership and the take-over from a lost rank 0 (dptrain.strategies.async_takeover): docs/how-to/async.md.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from dptrain.runtime.distributed import DistContext, PeerFailure
from dptrain.runtime.group import first_line
from dptrain.runtime import signed
from dptrain.runtime.heartbeat import STORE_DEADLINE
from dptrain.runtime.membership import STALL, Evicted, gone
from dptrain.runtime.store_keys import ASYNC_MEMBERS
from dptrain.strategies.collectives import module_state, unflatten_into
from dptrain.strategies.compression import decode, payload_bytes

MERGES = ("delta", "ema", "delayed-nesterov")
DELTA_MERGES = ("delta", "delayed-nesterov")  # merges of a change (which can be compressed), not a model
# Message kinds (first header field) and tags (one per message role, so they never cross).
MERGE, VERSION, REFRESH, DONE = 1, 2, 3, 4
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY, TAG_GLOBAL = 11, 12, 13, 14
# A request: (kind, rank, base version, stopping[, the epoch the worker is in or starts next]);
# a reply: (version, staleness, stop requested, membership generation[, left out]). The fields in
# brackets travel with live membership only (LIVE_HEADER_SIZE), so that other runs send what they did.
HEADER_SIZE, LIVE_HEADER_SIZE = 4, 5
LOST_POLL = 0.5  # seconds between the service's looks at the heartbeats and the launcher's exit notes
# How rank 0 concludes the run for a rank that is done (the first field of the reply to DONE).
FINISH, STOP = 1, 2
# The service waits for requests without a deadline (see MergeService._receive_request).
SERVICE_GROUP_TIMEOUT = timedelta(days=7)


def members_key(group_generation: int, generation: int) -> str:
    """Where a merge service serving the workers of group generation `group_generation` writes its generation
    `generation` (from 1) of members: each service (the first, and one per take-over) has keys of its own."""
    return f"{ASYNC_MEMBERS}{group_generation}/{generation}"


def taken_over(rank: int) -> str:
    """What a service host left out by a take-over says (it was frozen, or its heartbeat was late)."""
    return (f"rank {rank}: the other workers went on without this one and its merge service (they judged it "
            "gone: no heartbeat, frozen or too slow) and took the global model over; it stops")


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
        """One merge of the delayed Nesterov rule (docs/how-to/async.md has the rule and why)."""
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
            # each worker's merge count; a resume on another number of workers keeps those of the places both have
            self.merges = (list(saved["merges"]) + [0] * self.workers)[:self.workers]
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
    """Rank 0's thread: answers remote workers' merge, version and refresh requests until all are done.

    With `live` (live membership), it also leaves out lost workers (`lose`) and goes on with the others."""

    def __init__(self, model: GlobalModel, group, ctx: DistContext, compression: str = "none", every: int = 1,
                 live: bool = False, takeover: Optional[str] = None, ranks: Optional[list[int]] = None) -> None:
        self.model, self.group, self.ctx = model, group, ctx
        # The run's ranks of the service group's (those whose heartbeats tell whether a silent one is gone): all of
        # them, or with a sharded model one of each replica group (rank j of each serves shard j)
        self.ranks = list(ranks) if ranks is not None else list(range(ctx.world_size))
        self.compression, self.every, self.live = compression, every, live
        self.group_generation = ctx.group.generation  # names this service's keys in the store (`members_key`)
        # The store key the other workers set when they judge this rank gone and take over (None: they cannot):
        # once it is there, this rank is out of the run, even if it was only frozen (`taken_over`).
        self.takeover, self.taken_over = takeover, False
        self.pending = set(range(1, len(self.ranks)))
        self.members = list(range(len(self.ranks)))  # the workers merging now (ranks of the service group)
        self.epochs: dict[int, int] = {}  # the epoch each worker last said it is in or starts next
        self.generation = 0  # how many times the members changed
        self.lost: list[tuple[int, str]] = []  # (rank, why), in the order they were lost
        self.finished: list[int] = []  # ranks done with training that wait for rank 0's conclusion
        self.error: Optional[str] = None
        self.header_size = LIVE_HEADER_SIZE if live else HEADER_SIZE
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._thread = threading.Thread(target=self._serve, name="dptrain-merge-service", daemon=True)

    def start(self) -> "MergeService":
        self._thread.start()
        if self.live:
            self._watcher = threading.Thread(target=self._watch, name="dptrain-merge-watch", daemon=True)
            self._watcher.start()
        return self

    def _receive_request(self) -> torch.Tensor:
        # Blocks until some worker asks: the service group's timeout is effectively infinite,
        # since a worker may train for hours between merges. Liveness is judged from heartbeats
        # by join(), not by this wait.
        header = torch.zeros(self.header_size, dtype=torch.int64)
        self.group.recv(header, tag=TAG_REQUEST)  # from any worker
        return header

    def _fields(self, *values: int) -> torch.Tensor:
        return torch.tensor(values[:self.header_size], dtype=torch.int64)

    def _serve(self) -> None:
        try:
            while self.pending:
                header = self._receive_request()
                kind, rank, base_version, stopping, *rest = (int(v) for v in header)
                epoch = rest[0] if rest else 0
                try:
                    self._answer(kind, rank, base_version, stopping, epoch)
                except Exception as exc:  # noqa: BLE001 - with live membership, that worker is lost
                    if not self.live:
                        raise
                    self.lose(rank, f"its exchange with the merge service failed: {first_line(exc)}")
        except Exception as exc:  # noqa: BLE001 - reported by rank 0's training thread
            self.error = first_line(exc)

    def _answer(self, kind: int, rank: int, base_version: int, stopping: int, epoch: int) -> None:
        if rank not in self.members:  # left out while frozen, and awake again: it must stop
            if kind == MERGE:
                self._receive_payload(rank)
            self._send(self._fields(0, 0, 0, self.generation, 1), rank, TAG_REPLY)
            return
        if kind == DONE:
            with self.model.lock:  # `lose` (the watcher's thread) rewrites these lists
                self.pending.discard(rank)
                if not stopping:
                    self.finished.append(rank)
            if stopping:  # it has checkpointed and leaves now; the others stop at their next merge
                self.model.stop_requested = True
                self._conclude_for(rank, STOP)
            return
        self.epochs[rank] = epoch
        if kind == MERGE:
            payload = self._receive_payload(rank)
            state, version, staleness = self.model.apply(rank, payload, base_version)
        else:
            state, version = self.model.snapshot(copy=kind == REFRESH)
            staleness = version - base_version
        reply = self._fields(version, staleness, int(self.model.stop_requested), self.generation, 0)
        self._send(reply, rank, TAG_REPLY)
        if kind in (MERGE, REFRESH):
            self._send(state, rank, TAG_GLOBAL)

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> None:
        """One message to `rank`; with live membership bounded by the run's timeout (a frozen worker)."""
        if not self.live:
            self.group.send(tensor, rank, tag)
            return
        self.group.isend(tensor, rank, tag).wait(timeout=timedelta(seconds=self.ctx.timeout))

    def _receive_payload(self, rank: int) -> torch.Tensor:
        """A worker's merge payload as float32: received as is, or as encoded bytes and decoded."""
        numel = self.model.state.numel()
        if self.compression == "none":
            payload = torch.empty_like(self.model.state)
        else:
            payload = torch.empty(payload_bytes(self.compression, numel), dtype=torch.uint8)
        if self.live:  # a worker frozen in the middle of its merge holds the service up for --timeout at most
            self.group.irecv(payload, rank, TAG_PAYLOAD).wait(timeout=timedelta(seconds=self.ctx.timeout))
        else:
            self.group.recv(payload, rank, TAG_PAYLOAD)
        return payload if self.compression == "none" else decode(self.compression, payload, numel)

    # -- live membership ------------------------------------------------------------------------
    def _watch(self) -> None:
        """Leave out workers whose process ended (the launcher's note) or whose heartbeat stopped."""
        store, heartbeat, job = self.ctx.group.store, self.ctx.heartbeat, list(self.ctx.group.members)
        while not self._closed.wait(LOST_POLL):
            others = [rank for rank in self.members if rank != 0]
            try:
                if self.takeover is not None and signed.present(store, self.takeover):
                    self.taken_over = True  # the training thread stops at its next look (`Async._check_service`)
                    return
                lost = gone(store, heartbeat, others, STALL, in_store=lambda rank: job[rank])
            except Exception:  # noqa: BLE001 - the store is going away: the run is ending
                return
            for rank, why in lost.items():
                self.lose(rank, why)

    def lose(self, rank: int, why: str) -> None:
        """Leave `rank` out: merge over the others from now on, and tell them (a new generation in the store)."""
        with self.model.lock:
            # once rank 0 concludes, the members are settled: the workers left build their final group of them
            if rank not in self.members or rank == 0 or self._closed.is_set():
                return
            self.members.remove(rank)
            self.pending.discard(rank)
            self.finished = [done for done in self.finished if done != rank]
            self.model.workers = len(self.members)
            self.lost.append((rank, why))
            # every worker left starts this epoch only after its next merge, which tells it
            known = [self.epochs[member] for member in self.members if member in self.epochs]
            epoch = max(known, default=0) + self.every
            job = self.ctx.group.members
            record = (f"{','.join(str(job[member]) for member in self.members)};{epoch};"
                      f"{','.join(str(job[gone]) for gone, _ in self.lost)}")
            key = members_key(self.group_generation, self.generation + 1)
            signed.put(self.ctx.group.store, key, record)
            self.generation += 1  # announced in replies only once the store holds it
        print(f"dptrain: the merge service left rank {job[rank]} out ({why}); it merges over "
              f"{len(self.members)} workers from now on", flush=True)

    def _conclude_for(self, rank: int, outcome: int) -> None:
        self._send(self._fields(outcome, 0, 0, self.generation, 0), rank, TAG_REPLY)

    def conclude(self, outcome: int) -> None:
        """Answer every finished rank (after join): FINISH, or STOP when the run stops to be continued.
        From here on nobody is left out any more (each answer names the final generation)."""
        with self.model.lock:
            self._closed.set()
        if self._watcher is not None:  # not inside a store call when the process group goes
            self._watcher.join(timeout=STORE_DEADLINE)
        for rank in self.finished:
            self._conclude_for(rank, outcome)
        self.finished.clear()

    def join(self) -> None:
        """Wait until every remote worker is done (or, with live membership, lost); without live membership,
        fail naming those whose heartbeat stopped."""
        while self._thread.is_alive() and self.pending:  # with live membership, the last may be lost instead
            self._thread.join(timeout=LOST_POLL if self.live else 1.0)
            if self.taken_over:
                raise Evicted(taken_over(self.ctx.group.members[0]))
            if self.error or self.ctx.heartbeat is None or self.live:
                continue
            silent = self.ctx.heartbeat.stalled([self.ranks[rank] for rank in sorted(self.pending)], self.ctx.timeout)
            if silent:
                names = ", ".join(map(str, silent))
                raise PeerFailure(f"rank 0: rank{'s' if len(silent) > 1 else ''} {names} stopped responding for "
                                  f"{self.ctx.timeout:g} s before finishing (no heartbeat)")
        if self.error:
            raise PeerFailure(f"rank 0: the merge service failed: {self.error}")

