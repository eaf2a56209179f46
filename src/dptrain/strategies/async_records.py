"""async's account of who trained what: each worker's numbers of the epochs whose work reached the global model,
kept across lost workers and resumes, and the shares of the data that no worker's merge brought in.

Without a barrier an epoch's record holds one rank's numbers until the end. So each worker puts its numbers of
an epoch in the store once its merge has brought that epoch's work into the global model, rank 0 keeps the
others' in its checkpoints (a resumed run records what was trained before it), and at the end the workers
left read them back. Every epoch is shared by the members of the plan in force then (the run's first workers,
or the live ones from the epoch they took a loss at). A member's share of an epoch with no record of it never
reached the global model: its worker was lost before merging it, or the run resumed from a checkpoint that
worker had not written. With a sharded model (replica groups of S ranks merging together, each into the service
of its place) a record of any rank of a group says the group merged. The workers left train those rows at the end
(`Trainer` makes them up), so every row of every epoch is trained once: docs/how-to/async.md, "Every row once".
"""

from __future__ import annotations

import json
from typing import Optional

from dptrain.runtime import signed
from dptrain.runtime.store_keys import ASYNC_EPOCHS

Share = tuple[int, int, int]  # (epoch from 0, place among the members then, how many members then)


class TrainedShares:
    """The plans of a run's epochs and the records of the shares trained (this worker's, and on rank 0 the
    others' it read from the store); `untrained(epochs)`: the shares without a record."""

    def __init__(self) -> None:
        self.plans: list[tuple[int, tuple[int, ...]]] = []  # (first epoch from 0, ranks of the job sharing it)
        self.units: dict[int, int] = {}  # first epoch of a plan -> the ranks that merge together (a replica group)
        self.records: dict[int, dict[int, dict]] = {}  # epoch (from 1) -> rank of the job -> its numbers
        self._waiting: list[tuple[int, dict]] = []  # this worker's epochs not merged yet: (epoch from 1, numbers)
        # After a resume: the (epoch, rank) records a checkpoint says were merged. A worker's own file says so of each
        # epoch it merged before it saved (`unsure`: that merge may have come after the service's host saved the
        # global model the run continues); the host's file (`settled`) of those its saved global model holds.
        self.unsure: set[tuple[int, int]] = set()
        self.settled: Optional[set[tuple[int, int]]] = None

    # -- plans -------------------------------------------------------------------------------------
    def begin(self, epoch: int, members, unit: int = 1) -> None:
        """This attempt trains from `epoch` over `members`, in replica groups of `unit` consecutive members: the
        plans before it are a checkpoint's."""
        self.plans = [plan for plan in self.plans if plan[0] < epoch] + [(epoch, tuple(members))]
        self.units = {first: size for first, size in self.units.items() if first < epoch} | {epoch: unit}

    def change(self, epoch: int, members) -> None:
        """From `epoch` on the data is shared over `members` (a loss taken)."""
        self.plans = [plan for plan in self.plans if plan[0] < epoch] + [(epoch, tuple(members))]

    def unit_at(self, epoch: int) -> int:
        """The ranks that merged together in `epoch` (from 0): one, or a sharded run's replica group."""
        return next((self.units.get(first, 1) for first, _ in reversed(self.plans) if first <= epoch), 1)

    def members_at(self, epoch: int) -> Optional[tuple[int, ...]]:
        """The ranks of the job that shared `epoch` (from 0), or None where no plan is known (an older checkpoint)."""
        found = None
        for first, members in self.plans:
            if first <= epoch:
                found = members
        return found

    # -- records -----------------------------------------------------------------------------------
    def finished(self, epoch: int, numbers: dict, merged: bool, store) -> None:
        """This worker finished `epoch` (from 1) with `numbers`; `merged`: its work so far is in the global model
        now, so its waiting epochs count as trained (and go to the store for rank 0 and the workers left)."""
        self._waiting.append((epoch, numbers))
        if merged:
            self.all_merged(store)

    def all_merged(self, store=None) -> None:
        for epoch, numbers in self._waiting:
            self.records.setdefault(epoch, {})[numbers["rank"]] = numbers
            if store is not None:
                signed.put(store, record_key(numbers["rank"], epoch), json.dumps(numbers))
        self._waiting = []

    def read_missing(self, store, epochs: int) -> None:
        """Rank 0: the records of epochs 1..`epochs` that it lacks, from the store (absent ones stay absent)."""
        if store is None:
            return
        for epoch in range(epochs):
            members = self.members_at(epoch) or ()
            have = self.records.get(epoch + 1, {})
            for rank in members:
                if rank not in have and (said := signed.read(store, record_key(rank, epoch + 1))) is not None:
                    numbers = json.loads(said)
                    if isinstance(numbers, dict) and numbers.get("rank") == rank:
                        self.records.setdefault(epoch + 1, {})[rank] = numbers

    def add(self, records: dict) -> None:
        """Records another worker sent ({epoch: {rank: numbers}}, JSON's string keys allowed)."""
        for epoch, by_rank in records.items():
            for rank, numbers in by_rank.items():
                self.records.setdefault(int(epoch), {})[int(rank)] = numbers

    def drop_unsettled(self, unsure) -> None:
        """Rank 0, at the end: forget the records of `unsure` (the workers' (epoch, rank) pairs their checkpoints said
        were merged) that the global model this run continued does not hold (not in `settled`): a merge that came
        after the host saved it never reached the model the run went on from, so those shares are made up at the end
        (the worker's own model held that work, but its next delta was taken from a base that held it too)."""
        if self.settled is None:  # (not resumed, or from an older checkpoint: every record stands)
            return
        for epoch, rank in unsure:
            if (epoch, rank) not in self.settled:
                self.records.get(epoch, {}).pop(rank, None)

    def untrained(self, epochs: int) -> list[Share]:
        """The shares of epochs 0..`epochs`-1 that no record says were trained (a record of any rank of a replica
        group says the group merged: `unit_at`)."""
        owed = []
        for epoch in range(epochs):
            members, unit = self.members_at(epoch), self.unit_at(epoch)
            if members is None:
                continue
            have = self.records.get(epoch + 1, {})
            owed += [(epoch, place, len(members)) for place in range(len(members))
                     if not any(rank in have for rank in members[place - place % unit:place - place % unit + unit])]
        return owed

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plans and records (this worker's waiting epochs count: its file carries their work in its model, to be
        merged after a resume; `waiting` names them, apart from those merged already)."""
        records = {epoch: dict(by_rank) for epoch, by_rank in self.records.items()}
        for epoch, numbers in self._waiting:
            records.setdefault(epoch, {})[numbers["rank"]] = numbers
        return {"plans": [[first, list(members)] for first, members in self.plans], "records": records,
                "units": {str(first): unit for first, unit in self.units.items()},
                "waiting": [[epoch, numbers["rank"]] for epoch, numbers in self._waiting]}

    def load_state_dict(self, state: dict, host: bool = False) -> None:
        """A checkpoint's plans and records; `host`: the file of the global model's host, whose records are those
        that model holds (`settled`), where a worker's own are `unsure` (see `drop_unsettled`)."""
        self.plans = [(int(first), tuple(int(rank) for rank in members)) for first, members in state["plans"]]
        self.units = {int(first): int(unit) for first, unit in state.get("units", {}).items()}
        self.records, self._waiting = {}, []
        self.add(state["records"])
        if "waiting" not in state:  # (an older checkpoint: its records stand as they are)
            return
        pairs = {(epoch, rank) for epoch, by_rank in self.records.items() for rank in by_rank}
        if host:
            self.settled = pairs
        else:
            self.unsure = pairs - {(int(epoch), int(rank)) for epoch, rank in state["waiting"]}


def record_key(rank: int, epoch: int) -> str:
    """Where worker `rank` (of the job) puts its numbers of `epoch` (from 1) once they are merged."""
    return f"{ASYNC_EPOCHS}{rank}/{epoch}"
