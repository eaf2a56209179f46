"""The communication seam (runtime/group.py): every collective goes through a Group, which counts
the bytes, builds subgroups, and can be rebuilt with other members on the same store."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from distributed import run_distributed

SRC = Path(__file__).resolve().parents[1] / "src" / "dptrain"
SEAM = {"runtime/group.py"}
# What reaches another rank: torch.distributed's collectives, point-to-point messages, group
# construction, and DistributedDataParallel (its constructor and forward communicate).
COMMUNICATING = {"all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
                 "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
                 "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
                 "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group",
                 "new_subgroups", "new_subgroups_by_enumeration", "DistributedDataParallel",
                 "ProcessGroupGloo", "ProcessGroupNCCL"}


def communicating_calls(path: Path) -> list[str]:
    """`file:line name` for each call of a communicating torch.distributed function in `path`, whatever
    it was imported as (`dist.all_reduce`, `torch.distributed.all_reduce`, `from ... import all_reduce`),
    and for each import of torch's DDP communication hooks (they all-reduce inside)."""
    tree = ast.parse(path.read_text(), str(path))
    found, bare = [], set()  # bare: names imported from torch.distributed / torch.nn.parallel themselves
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "ddp_comm_hooks" in ast.unparse(node):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("torch.distributed",
                                                                                        "torch.nn.parallel")):
            bare |= {alias.asname or alias.name for alias in node.names if alias.name in COMMUNICATING}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if isinstance(node.func, ast.Attribute) and name in COMMUNICATING:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "c10d", "nn.parallel", "torch.nn.parallel") \
                    or owner.endswith("distributed_c10d"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {owner}.{name}")
        elif name in bare:
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1].split()[0]))  # by line


def test_no_module_outside_the_seam_calls_a_collective():
    outside = [call for path in sorted(SRC.rglob("*.py")) if str(path.relative_to(SRC)) not in SEAM
               for call in communicating_calls(path)]
    assert outside == [], "torch.distributed called outside runtime/group.py:\n" + "\n".join(outside)


def test_the_walk_finds_collectives_however_they_are_imported(tmp_path):
    global SRC
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed as dist\nfrom torch.distributed import barrier as b\n"
                      "from torch.nn.parallel import DistributedDataParallel\n"
                      "def f(t, m):\n    dist.all_reduce(t)\n    b()\n    torch.distributed.send(t, 1)\n"
                      "    DistributedDataParallel(m)\n    dist.get_rank()\n"
                      "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n")
    saved, SRC = SRC, tmp_path
    try:
        assert communicating_calls(sample) == ["sample.py:5 dist.all_reduce", "sample.py:6 b",
                                               "sample.py:7 torch.distributed.send",
                                               "sample.py:8 DistributedDataParallel",
                                               "sample.py:10 from torch.distributed.algorithms.ddp_comm_hooks "
                                               "import default_hooks"]
    finally:
        SRC = saved


def _job_group(rank, world):
    from dptrain.runtime.group import Group
    from dptrain.runtime.heartbeat import default_store
    return Group(rank, world, torch.device("cpu"), "gloo", 30.0, store=default_store())


def _rebuilt(rank, world):
    group = _job_group(rank, world)
    before = torch.tensor([float(rank + 1)])
    sent = group.all_reduce(before)
    new = group.rebuild([0, 2], generation=1)  # rank 1 leaves; the default group is untouched
    if new is None:
        return rank, before.item(), sent, None
    total = torch.tensor([float(rank + 1)])
    new.all_reduce(total)
    chosen = torch.tensor([float(rank)])
    new.broadcast(chosen, src=1)  # rank 1 of the new group: rank 2 of the job
    gathered, handed = new.all_gather(torch.tensor([rank], dtype=torch.int64))
    return rank, before.item(), sent, (new.rank, new.world_size, new.members, total.item(), chosen.item(),
                                       [int(t) for t in gathered], handed, new.handed_over)


def test_a_group_is_rebuilt_with_other_members_on_a_prefixed_store():
    results = run_distributed(_rebuilt, 3)
    assert [r[1] for r in results] == [6.0, 6.0, 6.0] and {r[2] for r in results} == {4}  # float32: 4 bytes
    assert results[1][3] is None
    # all_reduce of 1 and 3; broadcast from job rank 2; all_gather in member order; bytes: 4 + 4 + 8
    assert results[0][3] == (0, 2, [0, 2], 4.0, 2.0, [0, 2], 8, 16)
    assert results[2][3] == (1, 2, [0, 2], 4.0, 2.0, [0, 2], 8, 16)


def _parts(rank, world):
    group = _job_group(rank, world)
    part = group.split([[0, 1], [2, 3]], name="a node")
    leaders = group.subgroup([0, 2], name="the leaders")
    value = torch.tensor([float(rank)])
    part.broadcast(value, src=0)  # from the part's first rank
    message = torch.tensor([-1])
    if part.rank == 0:
        part.send(torch.tensor([10 * rank]), 1, tag=3)
    else:
        sender = part.recv(message, tag=3)
        message = torch.cat([message, torch.tensor([sender])])
    seen = None
    if leaders is not None:
        mine = torch.tensor([float(rank)])
        leaders.all_reduce(mine, "max")
        seen = (leaders.rank, leaders.members, mine.item())
    return part.rank, part.members, value.item(), message.tolist(), seen


def test_split_and_subgroup_speak_in_ranks_of_the_group():
    results = run_distributed(_parts, 4)
    assert results[0] == (0, [0, 1], 0.0, [-1], (0, [0, 2], 2.0))
    assert results[1] == (1, [0, 1], 0.0, [0, 0], None)  # rank 0's message, from the part's rank 0
    assert results[2] == (0, [2, 3], 2.0, [-1], (1, [0, 2], 2.0))
    assert results[3] == (1, [2, 3], 2.0, [20, 0], None)


def _peer_gone(rank, world):
    from dptrain.runtime.group import PeerFailure
    group = _job_group(rank, world)
    if rank == 1:
        return None  # leaves: its connections close
    try:
        group.any_rank("the stop check", False)
    except PeerFailure as exc:
        return str(exc)
    return "no failure"


def test_a_wait_on_a_rank_that_left_is_a_peer_failure_naming_what_waited():
    said = run_distributed(_peer_gone, 2)[0]
    assert said.startswith("rank 0: the stop check failed after ") and "cause: " in said, said


def test_gone_reads_the_exit_notes_and_heartbeats_of_the_job_ranks_behind_a_groups_ranks():
    """A merge service made after rank 0 was lost serves job ranks 1 and 2 as its ranks 0 and 1: whether its rank 1
    is gone is job rank 2's exit note and heartbeat, not job rank 1's (the service's own host)."""
    import time

    import torch.distributed as dist

    from dptrain.runtime.heartbeat import PREFIX, Heartbeat
    from dptrain.runtime.membership import EXITED, gone

    store = dist.HashStore()
    for job_rank in (1, 2):
        store.set(f"{PREFIX}{job_rank}", "1")
    heartbeat = Heartbeat(store, 1, 3)  # (not started: the test moves the counters)
    job = [1, 2]
    assert gone(store, heartbeat, [1], 0.2, in_store=lambda rank: job[rank]) == {}
    time.sleep(0.3)
    store.add(f"{PREFIX}1", 1)  # job rank 1 beats, job rank 2 does not
    assert gone(store, heartbeat, [0, 1], 0.2, in_store=lambda rank: job[rank]) == {
        1: "its heartbeat stopped for 0.2 s (frozen or gone)"}
    store.set(f"{EXITED}2", "1")
    assert gone(store, heartbeat, [1], 0.2, in_store=lambda rank: job[rank]) == {1: "its process ended"}


# -- the path NCCL takes, exercised on gloo (issue 38) ----------------------------------------------------
def _rebuilt_is_a_process_group(rank, world):
    import warnings

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_object_coll_device

    group = _job_group(rank, world).rebuild([0, 1], generation=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns (gloo) or raises (NCCL) when handed a bare backend
        device = _get_object_coll_device(group.handle)
    said = group.gather_objects("a check", {"rank": rank})
    late = torch.tensor([float(rank)])
    group.watch = 5.0
    if rank == 1:
        import time
        time.sleep(1.5)  # three times the heartbeat poll: a NCCL work waited for 0.5 s would be torn down here
    group.all_reduce(late)
    return isinstance(group.handle, dist.ProcessGroup), device, said, late.item(), group.any_rank("a flag", rank == 1)


def test_a_rebuilt_group_is_a_registered_process_group_for_every_collective_as_nccl_needs():
    results = run_distributed(_rebuilt_is_a_process_group, 2)
    assert results == [(True, "cpu", [{"rank": 0}, {"rank": 1}], 1.0, True)] * 2


class _Work:
    """A collective's work as torch hands it back, done after `after` looks; records each wait's timeout."""

    def __init__(self, after: int) -> None:
        self.looks, self.after, self.waits = 0, after, []

    def is_completed(self) -> bool:
        self.looks += 1
        return self.looks > self.after

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        if not self.is_completed():
            raise RuntimeError("Operation timed out!")
        return True


def test_a_watched_wait_polls_the_work_and_waits_once_when_done_never_with_a_short_timeout():
    """NCCL counts a work's timeout from when it was enqueued and aborts the communicator on expiry: a watched
    collective must not call wait(0.5 s) while it looks at the heartbeats, as it did, but wait once, when done."""
    from dptrain.runtime.group import Group

    group = Group(0, 2, torch.device("cpu"), "gloo", 30.0)
    group.watch = 5.0
    work = _Work(after=400)  # done after about 1 s of polling: two looks at the heartbeats
    group._finish(work, "an all-reduce")
    assert work.waits == [None]
