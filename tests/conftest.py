"""Shared pytest options."""


def pytest_addoption(parser):
    parser.addoption("--fault-runs", type=int, default=1,
                     help="runs of the fault-injection harness (tests/test_fault_injection.py); CI runs 1")
    parser.addoption("--fault-report", default=None,
                     help="write the fault-injection results (one JSON object per run) to this file")
    parser.addoption("--save-faults", default="subset", choices=("subset", "all"),
                     help="tests/test_save_faults.py: the CI subset of kill-during-save cases, or all 64")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_run_secret_left_by_another_test(monkeypatch):
    """A test that starts ranks in this process makes a run secret for them (dptrain.runtime.signed), which this
    process would then sign and check with: each test starts without one, as a fresh `dptrain` process does."""
    from dptrain.runtime import signed

    monkeypatch.delenv(signed.SECRET_ENV, raising=False)
    monkeypatch.setattr(signed, "_made", None)
    signed._warned.clear()


@pytest.fixture(autouse=True)
def _no_process_group_left_by_another_test():
    """A Trainer fitted in this process joins a one-rank default group and keeps it, as a user's script would
    (init_process_group is idempotent); each test starts without one, as a fresh process does."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from dptrain.runtime.distributed import destroy_process_group

        destroy_process_group()
