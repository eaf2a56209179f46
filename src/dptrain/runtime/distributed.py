"""The process group: gloo on CPU, NCCL on GPU, one rank pinned per GPU, every wait bounded.

`init_process_group(env, ...)` returns a DistContext that strategies and the trainer use. A
single process (no launcher) still gets a one-rank group from an in-memory store, so every
strategy runs the same code with one worker or many.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dptrain.errors import UserError, debugging
from dptrain.runtime.env import DistEnv
from dptrain.runtime import signed
from dptrain.runtime.group import REPORTED, REPORTED_SEEN, Group, PeerFailure, abandoned
from dptrain.runtime.heartbeat import Heartbeat, StoreUnanswered, bounded, default_store, store_abandoned
from dptrain.runtime.spawn import JOIN, STORE_FD, STORE_SERVED, job_store


@dataclass
class DistContext:
    """What strategies need to know about the job this process belongs to."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: float
    launcher: str = "single"
    heartbeat: Optional[Heartbeat] = None
    group: Optional[Group] = None  # every collective of the run goes through it (runtime/group.py)
    # A worker joining a running job (its rank of the job): alone until the run admits it (join_context).
    joining: Optional[int] = None

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = Group(self.rank, self.world_size, self.device, self.backend, self.timeout,
                               heartbeat=self.heartbeat)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def writes_results(self) -> bool:
        """Whether this rank writes the run's files and lines: rank 0, but never a worker not yet admitted to the
        running job it joins (alone in a group of its own until then)."""
        return self.is_main and self.joining is None

    @property
    def job_rank(self) -> int:
        """This process's rank of the job: the one it started with (a joiner's, the one it took), which a
        change of members does not renumber, unlike `rank` (its place in the current group)."""
        return self.group.members[self.rank]

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor handed to a collective must live: the GPU under NCCL, else the CPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


BACKEND_ENV = "DPTRAIN_BACKEND"  # gloo: every rank on the GPU talks through gloo (a GPU shared by ranks: gpu-check)


def backend_for(device: torch.device) -> str:
    """NCCL on a GPU, gloo on the CPU; DPTRAIN_BACKEND=gloo keeps CUDA tensors on gloo (two ranks on one GPU,
    which NCCL refuses: how `make gpu-check` runs several ranks on a machine with one)."""
    asked = os.environ.get(BACKEND_ENV, "")
    if asked not in ("", "gloo", "nccl"):
        raise UserError(f"{BACKEND_ENV}={asked!r} is not a backend dptrain runs on; give gloo or nccl, or unset it")
    if device.type != "cuda":
        return "gloo"
    return asked or "nccl"


def choose_device(preference: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when GPUs exist and are wanted, else CPU. Under NCCL a local rank past the visible GPUs
    is refused (two ranks on one GPU); under gloo (DPTRAIN_BACKEND) ranks share the GPUs modulo their number."""
    if preference == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if preference == "cuda":
            raise UserError("--device cuda was asked for but no CUDA GPU is visible to this process; use --device cpu or auto")
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if os.environ.get(BACKEND_ENV) == "gloo":
        return torch.device("cuda", local_rank % visible)
    if local_rank >= visible:
        raise UserError(f"local rank {local_rank} has no GPU of its own: {visible} visible on this node "
                        f"(cuda:0-{visible - 1}), and NCCL cannot run two ranks on one GPU; start at most {visible} "
                        f"workers per node (--workers, --tasks-per-node), or give --device cpu")
    return torch.device("cuda", local_rank)


# NCCL's watchdog, when a collective fails or passes its timeout: 2 (CleanUpOnly) aborts the communicator and
# lets the error reach the rank's wait, where dptrain says which peer failed in one line and live membership
# goes on without it; torch's default, 3, tears the process down without a word. A value the user set stays.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def init_process_group(env: DistEnv, *, device: str = "auto", timeout: float = 300.0) -> DistContext:
    """Join (or create) the default process group described by `env`; idempotent."""
    dev = choose_device(device, env.local_rank)
    backend = backend_for(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "nccl":
        os.environ.setdefault(*NCCL_ERROR_HANDLING)
    global _JOINED, _JOINED_AS
    _JOINED = True
    if os.environ.get(JOIN) and env.launched:
        return join_context(env, dev, backend, timeout)
    if dist.is_initialized() and _JOINED_AS is not None:
        env = _JOINED_AS  # joined before (e.g. by `dptrain train`): the launcher seen then, not the variables set since
    if not dist.is_initialized():
        _JOINED_AS = env
        wait = datetime.timedelta(seconds=timeout)
        if not env.launched:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
        else:
            options = {"device_id": dev} if backend == "nccl" else {}
            # User code sees the same variables as under torchrun.
            os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port),
                              RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank))
            where = f"rank {env.rank}: rendezvous at {env.master_addr}:{env.master_port}"
            try:
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                    # Under torchrun the agent already serves the store on MASTER_PORT; env:// joins it.
                    dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                            world_size=env.world_size, timeout=wait, **options)
                else:
                    # The same PrefixStore over a TCPStore that env:// would build, but with rank 0's
                    # listening address chosen here and every rank's wait bounded.
                    store = dist.PrefixStore("default_pg", rendezvous_store(env, timeout, where))
                    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                            timeout=wait, **options)
            except PeerFailure:
                raise
            except (RuntimeError, TimeoutError) as exc:
                raise PeerFailure(
                    f"{where} failed within {timeout:g} s "
                    f"({env.world_size} ranks expected, launcher {env.launcher}): {str(exc).splitlines()[0]}") from None
    world = dist.get_world_size()
    store = default_store() if world > 1 else None
    heartbeat = _heartbeat(store, dist.get_rank(), world)
    group = Group(dist.get_rank(), world, dev, dist.get_backend(), timeout, heartbeat=heartbeat, store=store)
    return DistContext(rank=dist.get_rank(), world_size=world, local_rank=env.local_rank,
                       device=dev, backend=dist.get_backend(), timeout=timeout, launcher=env.launcher,
                       heartbeat=heartbeat, group=group)


def join_context(env: DistEnv, device: torch.device, backend: str, timeout: float) -> DistContext:
    """A worker joining a running job (a replacement the launcher started, `dptrain join`): connected to the
    run's store only, with its rank of the job and its heartbeat, alone in a one-rank group until the run
    admits it (dptrain.runtime.membership: the trainer waits for that after preparing everything else)."""
    from dptrain.runtime.membership import take_rank

    if _JOINING:  # joined before (`dptrain train` joins, then its trainer asks again): the same rank
        store, rank = _JOINING
        return _alone(env, device, backend, timeout, store, rank)
    where = f"a joining worker: the run's store at {env.master_addr}:{env.master_port}"
    wait = datetime.timedelta(seconds=timeout)
    try:
        with _cpp_log_hidden():
            tcp = bounded(lambda: dist.TCPStore(env.master_addr, env.master_port, None, False, wait), timeout + 2)
        store = job_store(tcp)  # the keys the job's ranks see
        asked = os.environ[JOIN]
        rank = take_rank(store) if asked == "new" else int(asked)
    except (RuntimeError, TimeoutError, ValueError, StoreUnanswered) as exc:
        raise PeerFailure(f"{where} did not answer: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                          f" (the run has ended, or it is not one that takes joiners: --min-workers)") from None
    os.environ.update(RANK=str(rank))
    _JOINING[:] = [store, rank]
    return _alone(env, device, backend, timeout, store, rank)


_JOINING: list = []  # (the run's store, this worker's rank of the job) once this process joins a running job


def _alone(env: DistEnv, device: torch.device, backend: str, timeout: float, store, rank: int) -> DistContext:
    """A joining worker's context until it is admitted: alone in a one-rank group, its heartbeat beating."""
    heartbeat = _heartbeat(store, rank, 1)
    group = Group(0, 1, device, backend, timeout, heartbeat=heartbeat, store=store, members=[rank])
    return DistContext(rank=0, world_size=1, local_rank=env.local_rank, device=device, backend=backend,
                       timeout=timeout, launcher=env.launcher, heartbeat=heartbeat, group=group, joining=rank)


def store_served() -> bool:
    """Whether dptrain's launcher serves the store (--min-workers): it outlives every rank, rank 0 included."""
    return os.environ.get(STORE_SERVED) == "1"


def rendezvous_store(env: DistEnv, timeout: float, where: str) -> dist.TCPStore:
    """Rank 0 serves the TCPStore on the address `listen_address` picks (unless the launcher serves it:
    `store_served`); the others join it.

    Joining is bounded by `timeout`: torch retries a refused connection until then, but once
    connected it waits for the store's handshake with no deadline at all, so a program that is
    not a store (or a frozen rank 0) on MASTER_PORT would hang the rank forever. torch logs a
    failed handshake with a C++ stack on stderr before raising; the raised error says the same
    in one line, so the log is kept out of sight unless debugging.
    """
    wait = datetime.timedelta(seconds=timeout)
    if env.rank == 0 and not store_served():  # else the launcher serves it (--min-workers)
        handed = os.environ.pop(STORE_FD, None)  # dptrain's launcher listens on MASTER_PORT for us already
        if handed:
            listener_fd = int(handed)
            os.set_inheritable(listener_fd, False)
        else:
            listener_fd = _listen(env.master_addr, env.master_port, where).detach()
        with _cpp_log_hidden():
            # torch takes over the listening socket (its fd is torch's to close).
            return dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, wait,
                                 master_listen_fd=listener_fd)
    try:
        with _cpp_log_hidden():
            return bounded(lambda: dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait),
                           timeout + 2)  # torch's own timeout (rank 0 not up yet) should win the race
    except StoreUnanswered:
        raise PeerFailure(f"{where} failed: the server there accepted the connection but gave no answer within "
                          f"{timeout:g} s, so it is not a torch.distributed store (another program holds "
                          f"MASTER_PORT {env.master_port}) or rank 0 is frozen") from None
    except (RuntimeError, TimeoutError) as exc:
        if "ping failed" not in str(exc).lower():
            raise
        raise PeerFailure(f"{where} failed: something else answers there, not a torch.distributed store "
                          f"(another program holds MASTER_PORT {env.master_port}); choose a free port") from None


def listen_address(master_addr: str) -> str:
    """Where rank 0's store listens: nowhere it need not.

    A loopback MASTER_ADDR (dptrain's own launcher) -> that loopback address, so the store is
    unreachable from the network. An IP address of this host, or a name that resolves to a
    non-loopback address of this host (a scheduler's first node) -> that interface only. Else
    (a name that resolves to loopback here but to a real address on the other nodes, as
    Debian's 127.0.1.1 hostname entry does; an address this host does not have, e.g. behind
    NAT) -> every interface, as torch does by default ("").
    """
    if master_addr == "localhost":
        return "127.0.0.1"
    try:
        literal = ipaddress.ip_address(master_addr)
    except ValueError:
        literal = None
    try:
        resolved = ipaddress.ip_address(socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, ValueError):
        return ""
    if resolved.is_loopback:
        return str(resolved) if literal is not None else ""
    return str(resolved) if _is_local(resolved) else ""


def listen_exactly(host: str, port: int, where: str) -> socket.socket:
    """A listening socket on exactly the address `host` names (`dptrain serve-store --host`): never every
    interface, so a name that resolves to loopback here serves loopback only. A wildcard is refused."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise UserError(f"--host {host!r} does not resolve to an address of this host ({exc.strerror or exc}); give "
                        "the address (or name) of the interface the ranks reach") from None
    if ipaddress.ip_address(address[0]).is_unspecified:
        raise UserError(f"--host {host!r} is the wildcard address {address[0]} (every interface); give the address "
                        "(or name) of the one interface the ranks reach, e.g. the batch host's on the cluster network")
    try:
        return socket.create_server(address[:2], family=family)
    except OSError as exc:
        raise UserError(f"{where}: cannot serve on {address[0]}:{port}: "
                        f"{exc.strerror.lower() if exc.strerror else exc} (an address this host does not have, or a "
                        "port another program holds)") from None


def _is_local(address: "ipaddress.IPv4Address | ipaddress.IPv6Address") -> bool:
    """Whether this host has `address` (it can bind to it)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def _listen(master_addr: str, port: int, where: str) -> socket.socket:
    host = listen_address(master_addr)
    try:
        # create_server sets SO_REUSEADDR (a restarted world may reuse the port while the last
        # one's connections sit in TIME_WAIT); "" means every interface, IPv6 too, as torch binds.
        if host == "" and socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise PeerFailure(f"{where} failed: rank 0 cannot serve the store on {host or '*'}:{port}: "
                          f"{exc.strerror.lower() if exc.strerror else exc} (another program holds MASTER_PORT "
                          f"{port}?); choose a free port") from None


@contextmanager
def _cpp_log_hidden():
    """Send fd 2 to /dev/null while torch builds the store (unless debugging).

    torch's C++ log level (TORCH_CPP_LOG_LEVEL) is read once, when torch is imported, so it
    cannot be lowered here for this process; the rendezvous runs before any other thread of
    this process writes, so nothing else is lost.
    """
    if debugging():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    left_behind = False
    try:
        yield
    except StoreUnanswered:
        left_behind = True
        raise
    finally:
        if left_behind:
            # The store call still runs in a thread left behind (heartbeat.bounded), and torch logs its
            # C++ stack on fd 2 whenever it gives up, after dptrain's line: fd 2 stays on /dev/null for
            # the rest of this (failing) process, and Python's stderr writes to the real one.
            sys.stderr = os.fdopen(saved, "w", buffering=1, errors="backslashreplace")
        else:
            os.dup2(saved, 2)
            os.close(saved)


_HEARTBEATS: list[Heartbeat] = []  # at most one: this process's, until the group is destroyed


def _heartbeat(store, rank: int, world: int) -> Optional[Heartbeat]:
    """One heartbeat thread per process group, however many contexts are made for it."""
    if store is None:
        return None
    if not _HEARTBEATS:
        _HEARTBEATS.append(Heartbeat(store, rank, world).start())
    return _HEARTBEATS[0]


def stop_heartbeats() -> None:
    for heartbeat in _HEARTBEATS:
        heartbeat.stop()
    _HEARTBEATS.clear()


# Scripts using the Python API rarely tear the group down; stop the heartbeat before exit anyway.
atexit.register(stop_heartbeats)


def destroy_process_group() -> None:
    global _JOINED_AS
    _JOINED_AS = None
    stop_heartbeats()
    if store_abandoned():
        # A thread is still blocked inside a call to a frozen store host; destroying the store
        # under it aborts the process. The caller is failing anyway: exit_process ends it
        # without tearing the group down.
        return
    if dist.is_initialized() and not abandoned():  # a group left after a failure may hold work on a frozen peer
        dist.destroy_process_group()
        # Let gloo's worker threads take the GIL and release the last collective's tensors now,
        # not during interpreter finalization (see exit_process). This makes the abort at exit
        # rare for scripts that end normally (none in 51 two-rank runs against 4 in 94 without);
        # only exit_process rules it out.
        time.sleep(0.05)


LINGER = 3.0  # seconds the store's host waits, after an error of its own, for its peers to read it
_TOLD: list = []  # (store, world size) once this rank told its peers of its error and hosts the store
_SAID_FIRST: list = []  # (rank, exit code) of a peer whose own error reached the store before this rank's


def report_error(code: int) -> None:
    """This rank ends with an error it says in its own line: tell its peers, through the store, so that each
    ends with the same code and no line of its own (dptrain.runtime.group.PeerReported) instead of a second
    line about a peer that stopped (if a peer's own error got there first, this rank stays silent instead:
    error_said_first); then leave the group at once, so that no peer waits on this rank until
    --timeout. The store's host (rank 0, unless torchrun's agent serves it) stays at exit until its peers
    have read it, at most LINGER seconds (exit_process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or store_abandoned():
        return
    store, rank, world = default_store(), dist.get_rank(), dist.get_world_size()
    try:
        first = signed.claim(store, REPORTED, f"{rank} {code}", 1.0)
    except Exception:  # noqa: BLE001 - no store to tell: the peers diagnose the failure themselves
        return
    if first != f"{rank} {code}":  # two ranks failed at once (a full disk under both): the first one says it
        peer, peer_code = first.split()
        _SAID_FIRST.append((int(peer), int(peer_code)))
        try:
            bounded(lambda: store.add(REPORTED_SEEN, 1), 1.0)
        except Exception:  # noqa: BLE001 - its host is gone: nobody waits for this rank
            pass
    elif rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _TOLD.append((store, world))
    destroy_process_group()


def error_said_first() -> Optional[tuple[int, int]]:
    """(rank, exit code) of a peer that reported its own error before this rank reported its own, else None:
    that peer's line says why, and this rank's would be a second line for one failure (dptrain.exits)."""
    return _SAID_FIRST[0] if _SAID_FIRST else None


def _wait_until_told() -> None:
    """At exit: the store's host waits (at most LINGER s) until its peers have read its error."""
    for store, world in _TOLD:
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline:
            try:
                if bounded(lambda: store.add(REPORTED_SEEN, 0), 1.0) >= world - 1:
                    break
            except Exception:  # noqa: BLE001 - a store call that fails: nobody left to wait for
                break
            time.sleep(0.05)
    _TOLD.clear()


_JOINED = False  # whether this process ever joined a process group
_JOINED_AS: Optional[DistEnv] = None  # what the environment said when this process joined it


def exit_process(code: int, finalize: Optional[bool] = None) -> None:
    """End a program that used a process group without letting Python finalize the interpreter.

    Gloo's worker threads release each finished collective a moment after the caller sees it
    complete; releasing it drops tensors that may own Python objects, which needs the GIL. If
    that moment falls inside interpreter finalization the thread is unwound by force and the
    C++ runtime aborts the process (SIGABRT, "terminate called without an active exception",
    exit code 134) after the work finished: about one run in thirty of a two-rank job with
    torch 2.13 on gloo, a plain DDP script included. atexit handlers still run, the standard
    streams are flushed, then the process leaves with `code` and no finalization.

    A process that joined no group exits plainly (finalized), unless `finalize` is False.
    """
    if not _JOINED and finalize is not False:
        sys.exit(code)
    _wait_until_told()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def set_cpu_threads() -> None:
    """Honour OMP_NUM_THREADS set by the launcher (torch reads it only at import on some builds)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
