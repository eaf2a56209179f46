"""Shared pytest options."""


def pytest_addoption(parser):
    parser.addoption("--fault-runs", type=int, default=1,
                     help="runs of the fault-injection harness (tests/test_fault_injection.py); CI runs 1")
    parser.addoption("--fault-report", default=None,
                     help="write the fault-injection results (one JSON object per run) to this file")
    parser.addoption("--save-faults", default="subset", choices=("subset", "all"),
                     help="tests/test_save_faults.py: the CI subset of kill-during-save cases, or all 64")
