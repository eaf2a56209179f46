"""Which errors in a training step are a peer's (one line naming it) and which are the model's (its traceback).

DistributedDataParallel communicates in its forward too, before the user's module runs (the
bucket order after the first step): a peer lost there is a PeerFailure, while an error raised
inside the user's forward stays what it is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from distributed import run_distributed, toy_data


class Fragile(Dataset):
    """toy_data as a Dataset; once `armed`, the next item read raises (a broken file, say)."""

    def __init__(self):
        x, y = toy_data(64)
        self.x, self.y, self.armed = torch.from_numpy(x), torch.from_numpy(y), False

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        if self.armed:
            raise ValueError(f"item {index} cannot be read")
        return self.x[index], self.y[index]


class Model(nn.Module):
    """A 6-3 linear model that calls `at_step(n)` at the start of its n-th training forward."""

    def __init__(self, at_step):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.steps, self.at_step = nn.Linear(6, 3), 0, at_step

    def forward(self, x):
        if self.training:
            self.steps += 1
            self.at_step(self.steps)
        return self.net(x)


def _fit(model, data):
    from dptrain import AllReduce, Trainer
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", AllReduce(),
                      batch_size=8, progress=False, verbose=False, timeout=60, check_averages=False)
    try:
        trainer.fit(data, epochs=1)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc)
    return "finished", ""


def _peer_lost_before_the_forward(rank, world):
    data = Fragile()

    def arm(step):  # rank 0's second batch cannot be read: it stops after its first step
        if rank == 0 and step == 1:
            data.armed = True
    return _fit(Model(arm), data)


def test_a_peer_lost_while_ddp_syncs_before_the_forward_is_one_line_naming_the_forward():
    lost, waiting = run_distributed(_peer_lost_before_the_forward, 2)
    assert lost[0] == "UserError" and "raised ValueError: item " in lost[1], lost  # the Dataset's error, said
    # Rank 1 had entered its second forward: DDP's bucket rebuild waited on rank 0, which left.
    assert waiting[0] == "PeerFailure", waiting
    assert waiting[1].startswith("rank 1: forward failed after ")


def _model_error_in_the_forward(rank, world):
    def boom(step):
        if rank == 1 and step == 2:
            raise RuntimeError("boom in the user's forward")
    return _fit(Model(boom), Fragile())


def test_an_error_inside_the_users_forward_under_ddp_keeps_its_type():
    waiting, failed = run_distributed(_model_error_in_the_forward, 2)
    assert failed == ("RuntimeError", "boom in the user's forward")
    # Rank 0 was in its backward pass, whose all-reduce rank 1 never joined.
    assert waiting[0] == "PeerFailure" and waiting[1].startswith("rank 0: backward failed after "), waiting


def _both_fail_at_once(rank, world):
    import contextlib
    import datetime
    import io

    from dptrain import exits
    from dptrain.errors import UserError
    from dptrain.runtime.group import REPORTED
    from dptrain.runtime.heartbeat import default_store

    if rank == 0:  # rank 1's error reaches the store first, as when one full disk fails both ranks' writes
        default_store().wait([REPORTED], datetime.timedelta(seconds=30))

    def fail():
        raise UserError(f"rank {rank} cannot write: no space left on device")

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = exits.report_errors(fail)
    return code, said.getvalue()


def test_two_ranks_with_the_same_error_at_once_say_it_in_one_line():
    (code0, said0), (code1, said1) = run_distributed(_both_fail_at_once, 2)
    assert said1 == "dptrain: error: rank 1 cannot write: no space left on device\n"
    assert said0 == "" and code0 == code1 == 2
