"""Who trains: the one owner of a run's membership, called by the loop at its boundaries only.

    members = membership_for(ctx, recorder, options, ...)   # FixedMembership, or LiveMembership
    members.bind(strategy)                 # once the strategy is known
    members.from_peer / .start_from_peer(state)   # a worker joining a running run: its state from a peer
    members.epoch_begins(state)            # True: the world changed, the epoch is planned again
    members.step_done(state, ...)          # after each step (commits)
    members.failed(failure, state)         # a peer failed: re-raise, or go on from a kept state
    members.agree_stop(requested)          # at the epoch's end: the stop (and who leaves, who enters)
    members.epoch_ended(state, epochs)     # after the epoch's record: leave, admit and heal; True: replan
    members.note()                         # the change metrics.jsonl records with the next epoch
    members.lead(); members.end()          # async's take-over of rank 0; joiners still waiting go home

Without --min-workers (`FixedMembership`) a failure ends the run and the epoch end is the strategy's
stop agreement. With it (`LiveMembership`) the survivors of a failure agree on who is left through the
store (dptrain.runtime.membership) and go on from the state each kept (the epoch's start, or allreduce's
commits every --commit-every-steps), ranks asked to stop alone leave at an epoch end, and joiners enter
there, healed from rank 0 in one broadcast of tensors and plain values (a sharded run's replacement group, whole,
each rank from its peer in the first replica group: its shards only). The LR rule follows the live world.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from dptrain.errors import JoinedTooLate, Left, UserError
from dptrain.runtime import membership as protocol
from dptrain.runtime.distributed import store_served
from dptrain.runtime.group import Group, PeerFailure, PeerReported, UntrustedValue, first_line
from dptrain.runtime.membership import STALL, Membership, note, regroup
from dptrain.train import checkpoint_files
from dptrain.train.state import MembershipOptions, Position, TrainState


def workers(count: int) -> str:
    """"1 worker", "3 workers"."""
    return f"{count} worker{'s' if count != 1 else ''}"


def ranks(numbers) -> str:
    """"rank 2", "ranks 0, 1"."""
    return f"rank{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"


def scale_lr(rule: Optional[Callable[[int], float]], state: TrainState, before: int, world: int,
             log: Callable[[str], None]) -> None:
    """The LR rule's factor for `world` workers instead of `before` (optimizer, schedule, the guard's scale),
    where the trainer was given the rule."""
    if rule is None or world == before:
        return
    ratio = rule(world) / rule(before)
    if ratio == 1:
        return
    for group in state.optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if state.checks.lr_guard is not None:
        state.checks.lr_guard.scale *= ratio
    log(f"dptrain: learning rate x {ratio:.3g} for {workers(world)} instead of {before} "
        f"(the LR rule follows the live world): {state.optimizer.param_groups[0]['lr']:g}")


def check_received(state: Any, me: int, sender: int) -> dict:
    """The state a joiner was healed with (Group.broadcast_state: tensors and plain values only) is a dict of a
    dptrain state, or the joiner stops in one line."""
    if not isinstance(state, dict) or not {"epoch", "world", "strategy_name", "job_world", "history", "step"} <= set(state):
        raise UntrustedValue(f"rank {me}: healing the workers that join: rank {sender} sent a "
                             f"{type(state).__name__} that is not a dptrain state")
    return state


class FixedMembership:
    """The workers the run started with, to its end: a failure ends the run (every wait on a peer is bounded
    and names it), and the epoch end is the strategy's stop agreement."""

    from_peer = False  # whether this worker joins a running run: its state comes from a peer

    def __init__(self, ctx, recorder) -> None:
        self.ctx, self.recorder, self.strategy = ctx, recorder, None

    def bind(self, strategy, chosen: bool = False) -> None:
        """The strategy the run trains with (`chosen`: --strategy auto picked it)."""
        self.strategy = strategy

    def start_from_peer(self, state: TrainState, remake_checks: Callable[[bool], object]) -> None:
        raise AssertionError("only a live membership has joiners")

    def epoch_begins(self, state: TrainState) -> bool:
        return False

    def step_done(self, state: TrainState, done: int, total: int, seen: int, loss_sum, epoch_start: float) -> None:
        pass

    def failed(self, failure: PeerFailure, state: TrainState) -> None:
        raise failure

    def agree_stop(self, requested: Optional[str]) -> Optional[str]:
        return self.strategy.agree_stop(requested)

    def epoch_ended(self, state: TrainState, epochs: int) -> bool:
        return False

    def note(self) -> dict:
        return {}

    def lead(self) -> None:
        pass

    def end(self) -> None:
        pass


class LiveMembership(FixedMembership):
    """--min-workers: the run goes on without lost or departing workers, down to min_workers, and admits
    joiners (see the module's docstring). `whole_epoch(epoch, members)`: the rows of `epoch` as `members`
    share them (dptrain.data.sampler.Rest; over shards, positions: dptrain.data.streams.StreamRest);
    `forget_model()`: drop what holds the old group's module."""

    def __init__(self, ctx, recorder, options: MembershipOptions, *, timeout: float, seed: int, out,
                 batch_size: int, whole_epoch: Callable, forget_model: Callable[[], None]) -> None:
        super().__init__(ctx, recorder)
        self.options = options
        self.timeout, self.seed, self.out, self.batch_size = timeout, seed, out, batch_size
        self.whole_epoch, self.forget_model = whole_epoch, forget_model
        ctx.group.watch = STALL  # a frozen worker is given up after this long without a heartbeat
        self._kept: dict[tuple[int, int], dict] = {}  # (epoch, steps done) -> this rank's state then
        self._leaving: Optional[tuple] = None  # (ranks that stay, ranks that leave, their signals) at this epoch end
        self._admitting: tuple[int, ...] = ()  # ranks of the job (joiners) the run admits at this epoch end
        self._changed: Optional[Membership] = None  # the last change, recorded with the next epoch
        self._commits = 0  # steps between commits (0: none; for strategies meeting at every step)

    @property
    def from_peer(self) -> bool:
        return self.ctx.joining is not None

    def bind(self, strategy, chosen: bool = False) -> None:
        options = self.options
        if "min_workers" not in strategy.option_names():
            raise UserError(f"min_workers does not apply to strategy {strategy.name}: it cannot go on without a "
                            "lost worker")
        strategy.enable_live(options.min_workers)
        if options.commit_every_steps and not strategy.meets_every_step:
            if not chosen:
                raise UserError(f"commit_every_steps does not apply to strategy {strategy.name}: its workers do not "
                                "meet at every step, so a lost worker's epoch is redone from its start")
            self.recorder.log(f"dptrain: --commit-every-steps does not apply to {strategy.name}, which auto picked: "
                              "a lost worker's epoch is redone from its start")
        self.strategy = strategy
        self._commits = options.commit_every_steps if strategy.meets_every_step else 0

    # -- within an epoch ---------------------------------------------------------------------
    def epoch_begins(self, state: TrainState) -> bool:
        """Keep this rank's state at the epoch's start (or the commit within it it goes on from); async, which
        hears of a loss in its merges instead: from this epoch on, train in the live world it heard of."""
        if self.strategy.meets_at_epoch_ends:
            self._keep((state.epoch, state.position.steps if state.position else 0), state, state.position)
            return False
        heard = self.strategy.live_change(state.epoch)
        if heard is None:
            return False
        self._changed = self._follow(heard, state)
        return True

    def step_done(self, state: TrainState, done: int, total: int, seen: int, loss_sum, epoch_start: float) -> None:
        """Every `commit_every_steps` steps within an epoch (allreduce): this rank's state, in memory, for the
        survivors to go on from if a worker is lost later in the epoch."""
        if not self._commits or done % self._commits or done >= total:
            return
        position = Position(done, seen, torch.as_tensor(loss_sum).detach().cpu(), time.perf_counter() - epoch_start,
                            checkpoint_files.rng_state())
        self._keep((state.epoch, done), state, position)

    def _keep(self, at: tuple[int, int], state: TrainState, position: Optional[Position]) -> None:
        """Keep this rank's state at `at` (epoch, steps of it done) and the one before only: a rank may have
        passed the collective another failed in, and it continues from the one before then. States after `at`
        (a rank that had gone further, going back to `at` with the others) are dropped."""
        kept = self._kept
        before = max((key for key in kept if key < at), default=None)
        dropped = [kept.pop(key) for key in [key for key in kept if key != before]]
        kept[at] = state.snapshot(self.recorder.history, position, into=dropped[0] if dropped else None)

    def failed(self, failure: PeerFailure, state: TrainState) -> None:
        """After a peer failed: agree with the survivors on who is left and where to continue, return to this
        rank's state from then and take its new rank. From a commit within an epoch, the rest of that epoch's
        rows (every row no worker had read by then) is shared over the survivors (`state.rest`)."""
        if isinstance(failure, PeerReported) or not self.strategy.meets_at_epoch_ends:
            raise failure  # an error the job shares, or one async cannot go on after (rank 0 lost)
        ctx = self.ctx
        self.recorder.log(f"dptrain: {failure}; the workers left agree on who they are")
        # Where this rank stands (the epoch it failed in, at its start or latest commit); the survivors continue
        # from the earliest of theirs (one of them may have passed the collective another failed in).
        epoch, done = max(self._kept)
        before = tuple(ctx.group.members)
        group, membership = regroup(ctx.group, ctx.group.generation + 1, epoch, step=done,
                                    min_workers=self.options.min_workers, timeout=self.timeout,
                                    unit=self.strategy.live_unit)
        saved = self._kept[(membership.epoch, membership.step)]
        state.rest = self._rest_after(state.rest, membership, before)
        if membership.step:
            membership = replace(membership, rows_lost=state.rest.read_by(membership.left))
        state.load(saved)
        state.model.zero_grad(set_to_none=True)  # a backward pass the failure broke may have left gradients
        if len(self.recorder.history) != len(saved["history"]):
            self.recorder.replace_history(saved["history"])
        state.module, state.epoch = self._enter(group, state), membership.epoch
        within = (f" at step {membership.step} of it (its last commit; the rest of its rows shared over them)"
                  if membership.step else "")
        self.recorder.log(f"dptrain: continuing from epoch {membership.epoch + 1}{within} with "
                          f"{workers(group.world_size)} ({ranks(membership.members)} of the job; without "
                          f"{ranks(membership.left)})")
        self._changed = membership

    def _rest_after(self, rest, membership: Membership, before: tuple[int, ...]):
        """The rest of the epoch the survivors go on with from a commit (None from the epoch's start)."""
        if not membership.step:
            return None
        if rest is None or rest.epoch != membership.epoch or rest.members != before:
            rest = self.whole_epoch(membership.epoch, before)
        return rest.after(membership.step, membership.members, self.batch_size)

    # -- at the epoch's end ---------------------------------------------------------------------
    def agree_stop(self, requested: Optional[str]) -> Optional[str]:
        """The stop signal the whole run obeys at this epoch end, or None. Ranks asked to stop while others were
        not (a scheduler warned one node) leave instead, at this epoch end, when at least min_workers stay and
        none of them hosts the store (rank 0 where the launcher does not). Rank 0 also says which joiners are
        ready, while fewer workers train than max_workers (or the job's start)."""
        ctx = self.ctx
        if not self.strategy.meets_at_epoch_ends:
            return self.strategy.agree_stop(requested)
        room = (self.options.max_workers or self.recorder.job_world) - ctx.world_size
        ready = protocol.ready_joiners(ctx.group.store, room) if ctx.is_main and ctx.group.store is not None else ()
        ready = ready[:len(ready) - len(ready) % self.strategy.live_unit]  # a sharded run's replica groups join whole
        if ctx.world_size == 1:
            self._admitting = ready
            return self.strategy.agree_stop(requested)
        told = ctx.group.gather_objects("stop check", (requested, ready))
        asked = [signal for signal, _ in told]
        self._admitting = tuple(told[0][1])
        leave = tuple(member for member, signal in zip(ctx.group.members, asked) if signal)
        stay = tuple(member for member in ctx.group.members if member not in leave)
        if not leave:
            return None
        # (a sharded replica group cannot lose a rank it keeps training with: the whole job stops then)
        if len(stay) < self.options.min_workers or (0 in leave and not store_served()) or self.strategy.live_unit > 1:
            self._admitting = ()  # the job stops: checkpoint and exit 75, as without min_workers
            return requested or "a signal to another rank"
        self._leaving = (stay, leave, tuple(signal for signal in asked if signal))
        return None

    def epoch_ended(self, state: TrainState, epochs: int) -> bool:
        """After the epoch's record: the ranks asked to stop leave, the joiners ready enter (not after the last
        epoch). True when the members changed (the next epoch is planned again)."""
        changed = False
        if self._leaving is not None:
            self._changed, changed = self._let_leave(state), True
        if self._admitting and state.epoch + 1 < epochs:
            self._changed, changed = self._admit(state), True
        return changed

    def _let_leave(self, state: TrainState) -> Membership:
        """The ranks asked to stop alone leave (Left, exit 75) and the others go on without them from the next
        epoch, in a group of their own (no state to return to: nothing failed)."""
        ctx, epoch = self.ctx, state.epoch
        stay, leave, signals = self._leaving
        self._leaving = None
        me, names = ctx.group.members[ctx.rank], ", ".join(map(str, leave))
        generation = ctx.group.generation + 1
        ctx.group.abandon()  # nobody waits in it: its last collective (the stop check) is over
        if me in leave:
            raise Left(f"rank {me}: left the run after epoch {epoch + 1} on {signals[0]}; the other "
                       f"{len(stay)} worker{'s' if len(stay) > 1 else ''} go on without it")
        group = ctx.group.rebuild(stay, generation)
        assert group is not None
        state.module = self._enter(group, state)
        self.recorder.log(f"dptrain: rank{'s' if len(leave) > 1 else ''} {names} left after epoch {epoch + 1} "
                          f"on request ({signals[0]}); continuing with {workers(group.world_size)} ({ranks(stay)} "
                          "of the job)")
        return Membership(generation, stay, epoch + 1, leave)

    def _admit(self, state: TrainState) -> Membership:
        """The joiners rank 0 found ready enter; each is healed from rank 0 (its whole state, over the new group)
        and every worker trains on from the next epoch. A joiner lost before it trained is left out again at once
        (the others go on as they were)."""
        ctx, joiners, epoch = self.ctx, self._admitting, state.epoch
        self._admitting = ()
        old = ctx.group
        generation, members = old.generation + 1, (*old.members, *joiners)
        if ctx.is_main:
            protocol.admit(old.store, joiners, generation, members, epoch + 1)
        names = ", ".join(map(str, joiners))
        group = old.bounded(f"admitting rank{'s' if len(joiners) > 1 else ''} {names}",
                            lambda: old.rebuild(members, generation))
        try:
            healed = self._heal_entering(group, state, epoch + 1)
        except PeerFailure as failure:  # a joiner died before it trained: the others go on without it
            self.recorder.log(f"dptrain: {failure}; the workers agree on who is left")
            group, membership = regroup(group, generation + 1, epoch + 1, min_workers=self.options.min_workers,
                                        timeout=self.timeout, unit=self.strategy.live_unit)
            state.module = self._enter(group, state)
            return membership
        unit = self.strategy.live_unit
        source = f"rank {members[0]}" if unit == 1 else f"ranks {', '.join(map(str, members[:unit]))}, shard by shard"
        self.recorder.log(f"dptrain: rank{'s' if len(joiners) > 1 else ''} {names} joined after epoch {epoch + 1}, "
                          f"healed from {source} ({healed / 1e6:.2f} MB of state); continuing with "
                          f"{workers(group.world_size)} ({ranks(members)} of the job)")
        return Membership(generation, members, epoch + 1, (), joiners, healed)

    def _heal_entering(self, group: Group, state: TrainState, epoch: int) -> int:
        """Heal the joiners of `group` and train on in it; returns the bytes that travelled. A whole replica group
        that joins a sharded run: every rank enters first (the groups across then hold the joined group's ranks),
        then each takes its shards from its peer in the first group (`_heal_shards`)."""
        if self.strategy.live_unit == 1:
            healed = self._heal(group, state, epoch)[1]
            state.module = self._enter(group, state)
            return healed
        state.module = self._enter(group, state)
        return self._heal_shards(state, epoch)[1]

    def _heal_shards(self, state: TrainState, epoch: int, joining: bool = False) -> tuple[Optional[dict], int]:
        """Rank j of the first replica group hands its state, its own shards of the model, optimizer and strategy
        (never a whole model), to rank j of every other group over the groups across (`_heal`); returns (the state,
        on a joiner; the bytes that travelled over all S groups across, the same on every rank)."""
        replicas = self.strategy.replicas
        received, moved = self._heal(replicas.across, state, epoch, joining)
        total = torch.tensor([moved], dtype=torch.float64, device=replicas.inside.collective_device)
        replicas.inside.all_reduce(total)  # each group's S ranks: one of each of the S groups across
        return received, int(total.item())

    def _heal(self, group: Group, state: TrainState, epoch: int, joining: bool = False) -> tuple[Optional[dict], int]:
        """Rank 0 of `group` hands its whole state to every other worker of it, as tensors from where they are
        (Group.broadcast_state: no pickled blob, no copy of the state); the joiners load it in `start_from_peer`,
        the others already hold theirs and drop it. Returns (the state, on a joiner; the bytes that travelled)."""
        whole = None
        if group.rank == 0:
            whole = {**state.snapshot(self.recorder.history, host=False), "epoch": epoch,
                     "world": self.ctx.world_size, "strategy_name": self.strategy.name,
                     "job_world": self.recorder.job_world, **state.checks.heal_state()}
        return group.broadcast_state("healing the workers that join", whole, device=self.ctx.device, keep=joining)

    def start_from_peer(self, state: TrainState, remake_checks: Callable[[bool], object]) -> None:
        """A worker joining a running job (ctx.joining: its rank of the job), prepared alone: say it is ready,
        wait for the run to admit it at an epoch end, take the state of the new group's rank 0 and its place in
        the group. `remake_checks(job)`: the checks around the averages, made again as the job's workers made
        theirs."""
        ctx = self.ctx
        me = ctx.joining
        generation, members, epoch = self._admission(me)
        group = ctx.group.bounded("joining the run", lambda: Group.over_store(
            ctx.group.store, me, members, generation, device=ctx.device, backend=ctx.backend, timeout=self.timeout,
            heartbeat=ctx.heartbeat))
        group.watch = ctx.group.watch
        sharded = getattr(self.strategy, "shard_options", None) is not None
        if sharded:  # a replica group joins: it enters, then each rank takes its shards from its peer in a live group
            received = self._enter_sharded(group, state, epoch, me)
        else:
            received = check_received(self._heal(group, state, epoch, joining=True)[0], me, members[0])
        if received["strategy_name"] != self.strategy.name:  # --strategy auto: the choice made when the run began
            raise PeerFailure(f"rank {me}: the run trains with {received['strategy_name']}, this worker prepared "
                              f"{self.strategy.name}; it cannot join")
        ctx.world_size = received["world"]  # the world rank 0 trained in: the LR rule scales from it (_enter)
        state.checks = remake_checks(received["health"] is not None)
        for name, part in state.parts().items():
            if part is not None:
                part.load_state_dict(received[name])
        state.checks.load_heal(received)
        self.strategy.comm_bytes = 0  # this worker's own bytes count from here (rank 0's stay rank 0's)
        torch.manual_seed(self.seed + me)  # dropout and friends: this worker's own, reproducibly
        self.recorder.job_world = received["job_world"]
        if not sharded:
            state.module = self._enter(group, state)
        self.recorder.replace_history(received["history"])
        state.epoch, state.step = epoch, received["step"]

    def _enter_sharded(self, group: Group, state: TrainState, epoch: int, me: int) -> dict:
        """A rank of a replica group that joins a sharded run, admitted into `group`: its group's process group
        made and the model sharded over it (the strategy's `join_sharded`), its place taken in `group` (the groups
        across made with every rank), then its shards' values received from its peer in the first group."""
        ctx = self.ctx
        ctx.rank, ctx.world_size, ctx.group = group.rank, group.world_size, group
        group.bounded("sharding the replica group that joins", lambda: self.strategy.join_sharded(ctx))
        state.module = self._enter(group, state)
        across = self.strategy.replicas.across
        return check_received(self._heal_shards(state, epoch, joining=True)[0], me, across.members[0])

    def _admission(self, me: int) -> tuple[int, tuple[int, ...], int]:
        """Say this joiner is ready and wait for its admission: (generation, members, the epoch it enters at)."""
        store = self.ctx.group.store
        protocol.announce(store, me)
        print(f"dptrain: rank {me} is ready to join the run; it enters at the next epoch end with a free place",
              flush=True)
        try:
            admitted = protocol.admission(store, me)
        except Exception as exc:  # noqa: BLE001 - the store's host (the run's launcher) is gone
            if self.out is not None and (self.out / "summary.json").exists():  # it ended, and its launcher with it
                raise JoinedTooLate(f"rank {me}: the run ended before a place was free; this worker did not "
                                    "join") from None
            raise PeerFailure(f"rank {me}: the run's store stopped answering while this worker waited to join "
                              f"({first_line(exc)}): the run has ended or its launcher is gone") from None
        if admitted is None:
            raise JoinedTooLate(f"rank {me}: the run ended before a place was free; this worker did not join")
        return admitted

    # -- a new world -------------------------------------------------------------------------------
    def _enter(self, group: Group, state: TrainState):
        """Train on in `group` (made after a membership change): this rank's place in it; rank 0 may be the one
        gone, so the lowest rank left writes the files and lines from now on. Returns the module to train: the
        strategy's, bound to the new group (`Strategy.rebind`)."""
        ctx = self.ctx
        scale_lr(self.options.lr_rule, state, ctx.world_size, group.world_size, self.recorder.log)
        ctx.rank, ctx.world_size, ctx.group = group.rank, group.world_size, group
        self.recorder.lead(ctx.is_main)
        self.recorder.follow(tuple(group.members))
        self.forget_model()  # nothing may keep the old group's DDP (its hooks) alive
        return ctx.group.bounded("regroup", lambda: self.strategy.rebind(ctx))

    def _follow(self, heard: Membership, state: TrainState) -> Membership:
        """async (no common epoch end): from this epoch on train in the live world `heard` of a merge reply
        (the LR rule's W follows it; the trainer shares the data out again); the group stays until the end."""
        before = self.recorder.members or range(self.recorder.job_world)
        scale_lr(self.options.lr_rule, state, len(before), len(heard.members), self.recorder.log)
        self.recorder.follow(heard.members)
        self.recorder.log(f"dptrain: without {ranks(heard.left)}: {workers(len(heard.members))} share the data "
                          f"from epoch {heard.epoch + 1} ({ranks(heard.members)} of the job); async merged over "
                          f"them since the loss")
        return heard

    def note(self) -> dict:
        changed, self._changed = self._changed, None
        return {"membership": note(changed)} if changed is not None else {}

    def lead(self) -> None:
        """async: this rank became rank 0 when the others took over from a lost rank 0 (it holds the global
        model now): it writes the files and lines from here on."""
        if self.ctx.is_main and not self.recorder.is_main and not self.strategy.meets_at_epoch_ends:
            self.recorder.take_over(self.ctx.group.members[self.ctx.rank])

    def end(self) -> None:
        if self.ctx.is_main:
            protocol.finished(self.ctx.group.store)  # joiners still waiting for a place go home


def membership_for(ctx, recorder, options: MembershipOptions, **live) -> FixedMembership:
    """The membership of a run: live with options.min_workers, else fixed."""
    if options.min_workers is None:
        if ctx.joining is not None:
            raise UserError("a worker can join only a run with live membership (--min-workers)")
        return FixedMembership(ctx, recorder)
    return LiveMembership(ctx, recorder, options, **live)
