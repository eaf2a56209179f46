"""The communication seam: every collective a run makes goes through a Group.

A Group is the set of ranks a run talks to (the whole job, node leaders, the async merge
service) with its deadline and its heartbeat. Strategies, the trainer and the benchmarks reach
other ranks only through it: no module outside runtime/ calls a torch.distributed collective
(a test walks the source for that). Ranks given to a Group's methods are ranks *in the group*.

Every tensor collective returns the bytes this rank handed over (its payload, counted once,
here; an all-to-all: the parts it addresses to the other ranks), which is what strategies add to
`comm_bytes`; `handed_over` keeps the running total.

A Group can be closed and replaced by one with other members: `rebuild(members, generation)`
makes a fresh process group over the same rendezvous store under a new key prefix, without
touching the default group (live membership: dptrain.runtime.membership). It is a registered
torch ProcessGroup under gloo and NCCL alike (`process_group`), so the CPU suite runs the calls a
GPU will: no bare backend, no wait with a timeout shorter than the group's (`_finish` polls), the
host's read of a result inside `bounded`.

The waiting policy is `bounded`: a failed or timed-out wait on another rank becomes
PeerFailure naming the silent rank (from heartbeats). Which errors count as a peer failure is
decided by *where* they happen, not by their wording: torch's own distributed error types
always do, and so does any error of an operation that only communicates (our collectives on
tensors we built). An error in code that also runs the user's model (the backward pass)
counts only when the communication in it is known to have failed (`communication_failed`), so
a bug in a user's model keeps its own traceback.
"""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from dptrain.runtime import signed, state_wire
from dptrain.runtime.heartbeat import Heartbeat
from dptrain.runtime.store_keys import FAILED, REFUSED, REPORTED, REPORTED_SEEN  # noqa: F401 - for callers
from dptrain.runtime.heartbeat import bounded as store_call

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
WATCH_POLL = 0.5  # seconds between looks at the heartbeats while a watched collective waits
POLL_FIRST, POLL_MOST = 0.0001, 0.005  # seconds between looks at whether a watched work is done (doubling)
_DEFAULT_ABANDONED = False


def abandoned() -> bool:
    """Whether this process left the default group after a failure (it must not be destroyed then)."""
    return _DEFAULT_ABANDONED


class PeerFailure(RuntimeError):
    """A collective failed or timed out because another worker is gone or stuck."""


class PeerReported(PeerFailure):
    """A peer ended with an error it said in its own line (`report_error`): this rank ends with its code, silently."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code




def reported_error(store: Any) -> Optional[tuple[int, int]]:
    """(rank, exit code) of a peer that ended with an error it said itself, or None; counts this rank as told."""
    if store is None:
        return None
    try:
        said = signed.read(store, REPORTED, 1.0)
        if said is None:
            return None
        rank, code = said.split()
        store_call(lambda: store.add(REPORTED_SEEN, 1), 1.0)
    except Exception:  # noqa: BLE001 - the store's host is gone too: diagnose the failure as before
        return None
    return int(rank), int(code)


class UntrustedValue(PeerFailure):
    """A peer sent something that is not what dptrain exchanges (JSON, tensors): nothing of it was run."""


def encode_json(value: Any) -> bytes:
    """`value` as the bytes the object collectives carry (JSON: a value that is not JSON is a programming error)."""
    return json.dumps(value, separators=(",", ":")).encode()


def decode_json(data: bytes, what: str, sender: int) -> Any:
    """What rank `sender` (of the job) sent for `what`, read as JSON only: anything else (a pickle, say) is
    refused in one line and never run."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UntrustedValue(f"{what}: rank {sender} sent {len(data)} bytes that are not JSON "
                             f"(starting {data[:8]!r}); dptrain exchanges JSON and tensors only, so nothing "
                             f"of it was run") from None


def _byte_tensor(data: bytes, size: int) -> torch.Tensor:
    """`data` as a uint8 tensor of `size` elements (zeros after it): what the byte collectives carry."""
    tensor = torch.zeros(size, dtype=torch.uint8)
    if data:
        tensor[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


class QuietPeer(PeerFailure):
    """A watched collective gave up on members whose heartbeat stopped (its message names them already)."""


class Evicted(PeerFailure):
    """This rank was left out of the next generation (it froze or came too late); it must stop
    (dptrain.runtime.membership). Its message says so already."""


def payload_bytes(tensor: torch.Tensor) -> int:
    """The bytes a rank hands over when it gives `tensor` to a collective."""
    return tensor.numel() * tensor.element_size()


def process_group(store: Any, rank: int, size: int, backend: str, device: torch.device, timeout: float,
                  name: str) -> dist.ProcessGroup:
    """A ProcessGroup of `size` ranks over `store` with one backend, made as torch's own new_group makes one
    (distributed_c10d._new_process_group_helper), for groups made without the default group (`over_store`):
    every collective, DDP and an object collective alike, is then handed a registered ProcessGroup, under
    gloo and NCCL the same, never a bare backend (which torch's object collectives refuse under NCCL). The
    backend waits the run's `timeout` (torch's default for NCCL is 10 minutes); under NCCL the communicator
    is bound to `device` and connected now, not at the first collective."""
    wait = datetime.timedelta(seconds=timeout)
    group = dist.ProcessGroup(store, rank, size)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = wait
        made, kind, on = dist.ProcessGroupNCCL(store, rank, size, options), dist.ProcessGroup.BackendType.NCCL, ["cuda"]
    else:  # gloo carries CPU and CUDA tensors, as torch registers it (DPTRAIN_BACKEND=gloo on a GPU)
        made, kind, on = dist.ProcessGroupGloo(store, rank, size, wait), dist.ProcessGroup.BackendType.GLOO, ["cpu", "cuda"]
    made._set_sequence_number_for_group()
    group._set_default_backend(kind)
    for device_type in on:
        group._register_backend(torch.device(device_type), kind, made)
    group._set_group_name(name)
    if backend == "nccl" and device.type == "cuda":
        group.bound_device_id = device
        if made.supports_splitting:
            made.eager_connect_single_device(device)
    return group


class Group:
    """A set of ranks, its deadline, and every collective among them (see the module's docstring)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str, timeout: float, *,
                 heartbeat: Optional[Heartbeat] = None, handle: Any = None, store: Any = None,
                 members: Optional[Sequence[int]] = None, name: str = "the job", generation: int = 0) -> None:
        self.rank, self.world_size, self.device, self.backend = rank, world_size, device, backend
        self.timeout, self.heartbeat, self.store, self.name = timeout, heartbeat, store, name
        self.handle = handle  # the torch process group; None: the default one
        self.members = list(members) if members is not None else list(range(world_size))  # ranks of the job
        self.generation = generation  # how many times the job's members changed before this group
        # Live membership: give up a tensor collective once a member's heartbeat has been quiet this many
        # seconds (a frozen rank holds its connections open, so the wait would last the whole --timeout).
        self.watch: Optional[float] = None
        self.handed_over = 0
        self.closed = False
        self.over_the_store = False  # made by `rebuild`/`over_store`: groups made from it go over the store too
        self._made = 0  # groups made from this one over the store (`subgroup`, `split` of a rebuilt group)
        self.key = ""  # a group made over the store from a rebuilt one: its prefix after `group{generation}`

    @classmethod
    def default(cls, timeout: float = 300.0) -> "Group":
        """The default process group as a Group (for code handed no context, such as tests' helpers)."""
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), device, backend, timeout)

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor handed to a collective must live: the GPU under NCCL, else the CPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _count(self, tensor: torch.Tensor) -> int:
        sent = payload_bytes(tensor)
        self.handed_over += sent
        return sent

    # -- tensor collectives: each returns the bytes this rank handed over ----------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> int:
        """Reduce `tensor` over the group in place ("sum", "max" or "min")."""
        self._finish(dist.all_reduce(tensor, op=OPS[op], group=self.handle, async_op=self.watch is not None),
                     "an all-reduce")
        return self._count(tensor)

    def _finish(self, work: Any, what: str) -> None:
        """Wait for `work` (None: a blocking call already done) while watching the members' heartbeats
        (`watch`): PeerFailure naming those quiet for `watch` seconds; the work is left behind.

        The work is polled (`is_completed`, then a short sleep) and waited for once, when done: never with
        `wait(timeout)` shorter than the group's. Under NCCL a work's timeout counts from when it was
        enqueued and on expiry the watchdog aborts the communicator (and, by default, the process), so a
        half-second wait would end the run at the first skew between ranks; gloo takes the same path."""
        if work is None:
            return
        peers = [member for member in self.members if member != self.members[self.rank]]
        pause, looked = POLL_FIRST, time.monotonic()
        while not work.is_completed():
            time.sleep(pause)
            pause = min(pause * 2, POLL_MOST)
            if time.monotonic() - looked < WATCH_POLL:
                continue
            looked = time.monotonic()
            flag = f"{FAILED}{self.generation}"
            left = signed.read(self.store, flag) if self.store is not None else None
            if left is not None:  # (a value a process without the run's secret wrote there is ignored)
                # `left` is the member that met the failure first and left the group (not necessarily the one
                # lost: the agreement that follows names that one)
                raise QuietPeer(f"rank {self.members[self.rank]}: {what} was given up: rank {left} saw a worker fail "
                                f"in {self.name} and left it")
            quiet = self.heartbeat.stalled(peers, self.watch) if self.heartbeat is not None else []
            if quiet:
                raise QuietPeer(f"rank {self.members[self.rank]}: {what} waits on rank"
                                  f"{'s' if len(quiet) > 1 else ''} {', '.join(map(str, quiet))}, quiet for "
                                  f"{self.watch:g} s (no heartbeat): frozen or gone")
        work.wait()  # done: returns at once, or raises the error it ended with

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> tuple[Any, int]:
        """Start an all-reduce of `tensor` in place: (its work handle, bytes handed over)."""
        work = dist.all_reduce(tensor, op=OPS[op], group=self.handle, async_op=True)
        return work, self._count(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> int:
        """Make every rank's `tensor` rank `src`'s (in place)."""
        self._finish(dist.broadcast(tensor, group=self.handle, async_op=self.watch is not None,
                                    **self._peer("src", src)), "a broadcast")
        return self._count(tensor)

    def all_gather(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """(Every rank's `tensor`, in rank order; bytes handed over: this rank's one payload)."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._finish(dist.all_gather(gathered, tensor, group=self.handle, async_op=self.watch is not None),
                     "an all-gather")
        return gathered, self._count(tensor)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> tuple[Any, int]:
        """Every rank's `tensor` side by side in `output` (a sharded model's all-gather: dptrain.runtime.sharded).
        Returns (its work, or None when done; bytes handed over: this rank's `tensor`)."""
        work = dist.all_gather_single(output, tensor, group=self.handle, async_op=async_op)
        return work, self._count(tensor)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                            async_op: bool = False) -> tuple[Any, int]:
        """`tensor` reduced over the group, this rank's 1/N part of it in `output` (a sharded model's gradient
        reduce-scatter). Returns (its work or None; bytes handed over: the whole `tensor`, as an all-reduce's)."""
        work = dist.reduce_scatter_single(output, tensor, op=OPS[op] if isinstance(op, str) else op,
                                         group=self.handle, async_op=async_op)
        return work, self._count(tensor)

    def all_to_all(self, tensor: torch.Tensor, input_splits: Sequence[int],
                   output_splits: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Exchange parts of a flat `tensor`: its i-th part (`input_splits[i]` elements, in order) goes to rank i,
        and the result holds, in rank order, the part each rank addressed to this one (`output_splits[i]`
        elements from rank i). Returns (the received parts, one flat tensor; bytes handed over: the parts
        addressed to the other ranks, not the one this rank keeps, which goes to no one)."""
        if tensor.dim() != 1 or len(input_splits) != self.world_size or len(output_splits) != self.world_size \
                or sum(input_splits) != tensor.numel():
            raise ValueError(f"all_to_all takes a flat tensor and one split per rank ({self.world_size}), "
                             f"not {tuple(tensor.shape)} split {list(input_splits)} / {list(output_splits)}")
        received = torch.empty(sum(output_splits), dtype=tensor.dtype, device=tensor.device)
        self._finish(dist.all_to_all_single(received, tensor, list(output_splits), list(input_splits),
                                            group=self.handle, async_op=self.watch is not None), "an all-to-all")
        sent = (tensor.numel() - input_splits[self.rank]) * tensor.element_size()
        self.handed_over += sent
        return received, sent

    def _peer(self, kind: str, rank: Optional[int]) -> dict:
        """torch's keyword for a peer: `src`/`dst` (ranks of the job) on the default group,
        `group_src`/`group_dst` (ranks in the group) on any other."""
        if rank is None:
            return {}
        return {kind: rank} if self.handle is None else {f"group_{kind}": rank}

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> int:
        dist.send(tensor, group=self.handle, tag=tag, **self._peer("dst", dst))
        return self._count(tensor)

    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> int:
        """Receive into `tensor` from `src` (any rank when None); returns the sender's rank in the group.
        (Through the work's source rank, not torch's recv, which maps it to a rank of the default group: a
        group made by `rebuild` has none.)"""
        work = dist.irecv(tensor, group=self.handle, tag=tag, **self._peer("src", src))
        work.wait()
        return work._source_rank() if src is None else src

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        work = dist.isend(tensor, group=self.handle, tag=tag, **self._peer("dst", dst))
        self._count(tensor)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        return dist.irecv(tensor, group=self.handle, tag=tag, **self._peer("src", src))

    @staticmethod
    def wait_looking(work: Any, seconds: float, look: Callable[[], None], every: float) -> None:
        """Wait up to `seconds` for a point-to-point `work` (isend/irecv), calling `look` every `every` seconds
        meanwhile (it raises to give up; the work is left behind). The wait runs in a thread of its own, as long
        as the group's own timeout, never as short waits in turn: under gloo a point-to-point wait that times out
        closes every connection of the group ("Application timeout caused pair closure"), and its peers then see
        "Connection closed by peer". Meant for a group whose timeout is longer than any wait on it (the async
        merge service's)."""
        done, failed = threading.Event(), []

        def wait() -> None:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - raised in the caller's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name="dptrain-point-to-point", daemon=True).start()
        deadline = time.monotonic() + seconds + every  # (the thread's own wait ends first)
        while not done.wait(every):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"a point-to-point message was not done within {seconds:g} s")
            look()
        if failed:
            raise failed[0]

    # -- bookkeeping (metric traffic: never counted), each bounded and named ----------------
    # Values travel as JSON in a byte tensor, never pickled: a peer (or a process that took a peer's place
    # in a group) can send wrong values, but nothing it sends runs here. Tuples come back as lists.
    def gather_objects(self, what: str, value: Any) -> list:
        """Every rank's `value` (JSON: dicts, lists, strings, numbers, booleans, None), in rank order, on every rank."""
        mine = encode_json(value)
        if self.world_size == 1:
            return [self._decoded(mine, what, 0)]
        return [self._decoded(data, what, rank) for rank, data in enumerate(self.gather_bytes(what, mine))]

    def broadcast_object(self, what: str, value: Any, src: int = 0) -> Any:
        """Rank `src`'s `value` (JSON, as `gather_objects`) on every rank."""
        data = encode_json(value) if self.rank == src else None
        if self.world_size == 1:
            return self._decoded(data, what, src)
        return self._decoded(self.broadcast_bytes(what, data, src), what, src)

    def _decoded(self, data: bytes, what: str, sender: int) -> Any:
        """JSON from rank `sender` of this group; a sender of anything else is refused for the rest of the run
        (REFUSED: the next agreement on members leaves it out, so one bad member cannot make the others regroup
        with it again and again)."""
        try:
            return decode_json(data, f"rank {self.members[self.rank]}: {what}", self.members[sender])
        except UntrustedValue:
            if self.store is not None:
                signed.put(self.store, f"{REFUSED}{self.members[sender]}", "1")
            raise

    def gather_bytes(self, what: str, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (a length, then the bytes padded to the longest)."""
        if self.world_size == 1:
            return [data]

        def gather() -> list[bytes]:
            lengths = self._gathered(torch.tensor([len(data)], dtype=torch.int64), what)
            sizes = [int(length.item()) for length in lengths]
            gathered = self._gathered(_byte_tensor(data, max(sizes)), what)
            return [bytes(part.cpu()[:size].numpy().tobytes()) for part, size in zip(gathered, sizes)]

        return self.bounded(what, gather)

    def broadcast_bytes(self, what: str, data: Optional[bytes], src: int = 0) -> bytes:
        """Rank `src`'s `data` on every rank (a length, then the bytes); counted in no comm_bytes."""
        if self.world_size == 1:
            return data

        def broadcast() -> bytes:
            length = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64,
                                  device=self.collective_device)
            self._broadcast_watched(length, src, what)
            size = int(length.item())
            payload = _byte_tensor(data if self.rank == src else b"", size).to(self.collective_device)
            if size:
                self._broadcast_watched(payload, src, what)
            return data if self.rank == src else bytes(payload.cpu().numpy().tobytes())

        return self.bounded(what, broadcast)

    def broadcast_state(self, what: str, tree: Any, src: int = 0, device: Optional[torch.device] = None,
                        keep: bool = True) -> tuple[Any, int]:
        """Rank `src`'s `tree` (dicts, lists and tuples of tensors and plain values: a training state) on every
        rank, as tensors (dptrain.runtime.state_wire): its structure in one broadcast of bytes read with
        weights_only, its tensors' bytes in buckets broadcast on the collective device. Returns (the tree:
        `src`'s own on `src`; elsewhere a copy whose tensors are on `device`, or on the CPU where `src`'s were,
        or None where not `keep`; the bytes that travelled). Counted in no comm_bytes; a structure that is not
        tensors and plain values is refused in one line naming the sender, and nothing of it runs."""
        sender = self.rank == src
        skeleton, tensors = state_wire.split(tree) if sender else (None, [])
        data = self.broadcast_bytes(what, state_wire.header(skeleton, tensors) if sender else None, src)
        if self.world_size == 1:
            return tree, len(data)
        me, them = self.members[self.rank], self.members[src]

        def refuse(why: str) -> UntrustedValue:
            return UntrustedValue(f"rank {me}: {what}: rank {them} sent {len(data)} bytes that are not a dptrain "
                                  f"state of tensors and plain values ({why}); nothing of it was run")

        if not sender:
            skeleton, specs = state_wire.read_header(data, refuse)
        else:
            specs = [state_wire.Spec(t.dtype, tuple(t.shape), t.device.type == "cpu") for t in tensors]
        received: dict[int, torch.Tensor] = {}

        def broadcast() -> int:
            moved = len(data)
            for bucket in state_wire.buckets(specs):
                payload = state_wire.pack(bucket, tensors, self.collective_device) if sender else \
                    torch.empty(bucket.size, dtype=torch.uint8, device=self.collective_device)
                if bucket.size:  # (tensors of no elements only: nothing to send)
                    self._broadcast_watched(payload, src, what)
                if not sender and keep:
                    state_wire.unpack(bucket, payload, specs, device, received)
                moved += bucket.size
            return moved

        moved = self.bounded(what, broadcast)
        if sender:
            return tree, moved
        return (state_wire.join(skeleton, [received[i] for i in range(len(specs))]) if keep else None), moved

    def _gathered(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's `tensor` (all-gather, watched like any tensor collective; not counted)."""
        tensor = tensor.to(self.collective_device)
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._finish(dist.all_gather(gathered, tensor, group=self.handle, async_op=self.watch is not None), what)
        return gathered

    def _broadcast_watched(self, tensor: torch.Tensor, src: int, what: str) -> None:
        self._finish(dist.broadcast(tensor, group=self.handle, async_op=self.watch is not None,
                                    **self._peer("src", src)), what)

    def any_rank(self, what: str, flag: bool) -> bool:
        """Whether `flag` is true on at least one rank (every rank waits for all)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1 if flag else 0], device=self.collective_device)

        def reduce() -> bool:  # the host's read of the result inside `bounded`: under NCCL that is where it waits
            self._finish(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.handle,
                                         async_op=self.watch is not None), what)
            return bool(value.item())

        return self.bounded(what, reduce)

    def sum_tensor(self, what: str, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over all ranks (returned on the CPU)."""
        if self.world_size == 1:
            return values
        reduced = values.to(self.collective_device)

        def reduce() -> torch.Tensor:  # read back inside `bounded` (NCCL returns once the work is enqueued)
            self._finish(dist.all_reduce(reduced, group=self.handle, async_op=self.watch is not None), what)
            return reduced.cpu()

        return self.bounded(what, reduce)

    def barrier(self, what: str) -> None:
        """Every rank here, through an all-reduce of one number read back on the host (what torch's barrier
        does under NCCL too, there without a device it knows: a group made over the store has none bound)."""
        if self.world_size > 1:
            self.any_rank(what, False)

    # -- groups built from this one ------------------------------------------------------------
    def subgroup(self, ranks: Sequence[int], *, backend: Optional[str] = None, timeout: Optional[float] = None,
                 name: str = "a subgroup") -> Optional["Group"]:
        """A group of `ranks` (of this group). Every rank of this group must call it; ranks outside
        `ranks` get None. `backend` gloo gives a CPU side channel beside an NCCL job."""
        wait = self.timeout if timeout is None else timeout
        if self._rebuilt:  # a group made by `rebuild` (no default group to make it from): over the store
            chosen = backend or self.backend
            key = self._next_key()
            if self.rank not in ranks:
                return None
            return self._over_store_part(list(ranks), key, chosen, wait, name)
        handle = dist.new_group(list(ranks), backend=backend, timeout=datetime.timedelta(seconds=wait))
        if self.rank not in ranks:
            return None
        chosen = backend or self.backend
        device = self.device if chosen == "nccl" else torch.device("cpu")
        return self._watched_like_this(Group(list(ranks).index(self.rank), len(ranks), device, chosen, wait,
                                             heartbeat=self.heartbeat, handle=handle,
                                             members=[self.members[r] for r in ranks], name=name))

    def split(self, parts: Sequence[Sequence[int]], *, name: str = "a part") -> Optional["Group"]:
        """This rank's part of a partition of this group's ranks into groups (each rank in one part).
        Every rank must call it with the same `parts`; a rank alone in its part gets None."""
        part = next(list(part) for part in parts if self.rank in part)
        if self._rebuilt:  # a group made by `rebuild`: each part over the store
            key = self._next_key()
            if len(part) == 1:
                return None
            index = next(i for i, each in enumerate(parts) if self.rank in each)
            return self._over_store_part(part, f"{key}/{index}", self.backend, self.timeout, name)
        handle, _ = dist.new_subgroups_by_enumeration([list(part) for part in parts],
                                                      timeout=datetime.timedelta(seconds=self.timeout))
        if len(part) == 1:
            return None
        return self._watched_like_this(Group(part.index(self.rank), len(part), self.device, self.backend, self.timeout,
                                             heartbeat=self.heartbeat, handle=handle,
                                             members=[self.members[r] for r in part], name=name))

    def _watched_like_this(self, part: "Group") -> "Group":
        """A group made from this one watches as this one does (live membership: a frozen member, or one that
        left this generation after a failure, is given up in it too)."""
        if self.watch is not None:
            part.watch, part.store, part.generation = self.watch, self.store, self.generation
        return part

    @property
    def _rebuilt(self) -> bool:
        """Whether this group was made by `rebuild`/`over_store` (not from the default group, which may be gone)."""
        return self.over_the_store

    def _next_key(self) -> str:
        """The store key of the next group made from this one: every member makes them in the same order."""
        self._made += 1
        return f"/part{self._made}"

    def _over_store_part(self, ranks: list[int], key: str, backend: str, wait: float, name: str) -> "Group":
        """The group of `ranks` (of this one) over the store, under this group's prefix and `key`."""
        part = Group.over_store(self.store, self.members[self.rank], [self.members[r] for r in ranks],
                                self.generation, device=self.device if backend == self.backend else torch.device("cpu"),
                                backend=backend, timeout=wait, heartbeat=self.heartbeat, key=key, name=name)
        part.watch = self.watch
        return part

    def data_parallel(self, module: nn.Module, init_sync: bool = True,
                      **options: Any) -> nn.parallel.DistributedDataParallel:
        """`module` under DistributedDataParallel on this group (its gradient all-reduce, its broadcasts);
        without `init_sync`, its constructor broadcasts nothing (after a membership change)."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        if not init_sync:  # DDP takes init_sync since torch 2.4; the default is given as before it
            options["init_sync"] = False
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids, process_group=self.handle,
                                                   **options)

    def mean_gradients(self, buffer: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[Any, int]:
        """A DDP communication hook's work, through the seam: `buffer` (a gradient bucket) becomes its mean
        over the group, sent as is or cast to `dtype` (fp16/bf16 compression), as torch's allreduce_hook and
        fp16/bf16_compress_hook do (divide first, then sum). Returns (a future of the averaged bucket,
        bytes handed over)."""
        if dtype is None or dtype == buffer.dtype:
            buffer.div_(self.world_size)
            work, sent = self.all_reduce_async(buffer)
            return self._future(work, "a gradient all-reduce").then(lambda done: done.value()[0]), sent
        compressed = buffer.to(dtype).div_(self.world_size)
        work, sent = self.all_reduce_async(compressed)

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(done.value()[0])

        return self._future(work, "a gradient all-reduce").then(decompress), sent

    def _future(self, work: Any, what: str) -> torch.futures.Future:
        """The future of `work`; when watched (`watch`), one that a thread completes as `_finish` waits: it
        fails (QuietPeer) once a member's heartbeat stopped, where DDP, which waits for it, would wait the
        whole --timeout on a frozen rank."""
        if self.watch is None:
            return work.get_future()
        future: torch.futures.Future = torch.futures.Future()

        def wait() -> None:
            try:
                self._finish(work, what)
                future.set_result(work.result())
            except Exception as exc:  # noqa: BLE001 - DDP's backward raises it (a peer's failure)
                future.set_exception(exc)

        threading.Thread(target=wait, name="dptrain-watched-work", daemon=True).start()
        return future

    def wait(self, work: Any, what: str) -> None:
        """Wait for `work` (a non-blocking collective's) within the group's timeout; when watched (`watch`),
        give up as a tensor collective does on a member whose heartbeat stopped (QuietPeer)."""
        if self.watch is None:
            work.wait(datetime.timedelta(seconds=self.timeout))
        else:
            self._finish(work, what)

    def rebuild(self, members: Sequence[int], generation: int) -> Optional["Group"]:
        """A fresh group of `members` (ranks of the job) over the same store under the prefix
        `group{generation}/`, the default group untouched. Every member must call it with the same
        arguments; a rank outside `members` gets None. Closes this group first."""
        if self.store is None:
            raise RuntimeError(f"{self.name} has no rendezvous store to rebuild a group on")
        self.close()
        me = self.members[self.rank]
        if me not in members:
            return None
        new = Group.over_store(self.store, me, members, generation, device=self.device, backend=self.backend,
                               timeout=self.timeout, heartbeat=self.heartbeat)
        new.watch = self.watch
        return new

    @classmethod
    def over_store(cls, store: Any, me: int, members: Sequence[int], generation: int, *, device: torch.device,
                   backend: str, timeout: float, heartbeat: Optional[Heartbeat] = None, key: str = "",
                   name: Optional[str] = None) -> "Group":
        """Generation `generation` of `members` (ranks of the job; `me` among them) over the rendezvous `store`,
        under the prefix `group{generation}/`: what `rebuild` makes, and what a worker joining a running job
        makes without ever having been in a group of it (dptrain.runtime.membership). `key`: a group made from
        that one (`subgroup`, `split`), under its own prefix."""
        rank = list(members).index(me)
        handle = process_group(dist.PrefixStore(f"group{generation}{key}", store), rank, len(members), backend,
                               device, timeout, f"dptrain-group{generation}{key}")
        new = cls(rank, len(members), device, backend, timeout, heartbeat=heartbeat, handle=handle, store=store,
                  members=members, name=name or f"generation {generation}", generation=generation)
        new.key, new.over_the_store = key, True
        if heartbeat is not None and not key:  # the same thread beats on; it watches the new members only
            heartbeat.follow(members)
        return new

    def abandon(self) -> None:
        """Leave this group after a peer failed in it (dptrain.runtime.membership): say so in the store, where
        every member still waiting in a watched collective of it looks (`_finish`), and use it no more.
        Its work still pending stays behind: destroying a group whose collective waits on a frozen peer
        would wait for that peer, so the default group is never destroyed after this (`abandoned`)."""
        global _DEFAULT_ABANDONED
        if self.store is not None:
            signed.put(self.store, f"{FAILED}{self.generation}", str(self.members[self.rank]))
        if self.handle is None:
            _DEFAULT_ABANDONED = True
        if self.backend == "nccl":
            # NCCL: the communicator's hung work would keep the watchdog armed until it tears the process
            # down at --timeout; aborting it ends that work (gloo's pending work ends with its own timeout
            # and holds nothing else, so gloo leaves it).
            try:
                (self.handle or dist.distributed_c10d._get_default_group()).abort()
            except (RuntimeError, AttributeError, ValueError):
                pass
        self.closed = True

    def close(self) -> None:
        """Leave this group (a group made by `rebuild`: its connections are dropped; the default
        group is destroyed by the runtime, not here)."""
        if self.closed:
            return
        self.closed = True
        if self.handle is not None and hasattr(self.handle, "abort"):
            try:
                self.handle.abort()
            except RuntimeError:
                pass

    # -- the waiting policy ----------------------------------------------------------------------
    def bounded(self, what: str, action: Callable[[], Any], *,
                communication_failed: Union[bool, Callable[[], bool]] = True) -> Any:
        """Run `action`; turn a failed or timed-out wait on another rank into one line naming it."""
        begun = time.perf_counter()
        try:
            return action()
        except (QuietPeer, Evicted, UntrustedValue):  # each says what happened already
            raise
        except (dist.DistError, RuntimeError) as exc:  # a PeerFailure inside too: named with `what`
            if self.world_size == 1:
                raise
            if not isinstance(exc, dist.DistError):
                failed = communication_failed() if callable(communication_failed) else communication_failed
                if not failed:
                    raise
            waited = time.perf_counter() - begun
            told = reported_error(self.store)
            if told is not None:  # its line says why; a second line about it would only hide the first
                raise PeerReported(f"rank {self.rank}: {what} failed: rank {told[0]} ended with an error "
                                   f"(exit code {told[1]})", told[1]) from None
            if self.watch is not None:  # live membership finds out who is gone (dptrain.runtime.membership)
                who = "a peer failed"
            else:
                who = self.heartbeat.silent_peers() if self.heartbeat else "no heartbeat store to tell which peer"
            raise PeerFailure(
                f"rank {self.rank}: {what} failed after {waited:.1f} s (timeout {self.timeout:g} s): {who}; "
                f"cause: {first_line(exc)}") from None


# gloo's errors start with the C++ source line and end with advice to the reader ("This is typically caused by a
# remote worker crashing. ... GLHF!"): a cause in dptrain's lines keeps what happened, with whom.
_SOURCE_LINE = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h):\d+\]\s*")
_ADVICE = re.compile(r"\s*This is typically caused by .*$")


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, without a gloo error's source location and advice."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return _ADVICE.sub("", _SOURCE_LINE.sub("", lines[0].strip())) or lines[0]



