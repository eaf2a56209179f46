"""How a dptrain process ends: exit_process runs atexit handlers, flushes, keeps the exit code, skips finalization."""

import os
import subprocess
import sys
import textwrap

import pytest
from cli_runner import run_dptrain

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import dptrain
    from dptrain.runtime.distributed import destroy_process_group, init_process_group
    from dptrain.runtime.env import detect

    atexit.register(lambda: print("atexit ran", end="", file=sys.stderr))
    if sys.argv[1] == "group":
        init_process_group(detect({}), device="cpu", timeout=30)
        destroy_process_group()

    class Finalized:
        # Collected only by interpreter finalization: the message shows whether that happened.
        def __del__(self, write=os.write):
            write(2, b"finalized")

    keep = Finalized()
    print("unflushed output", end="")
    dptrain.exit_process(int(sys.argv[2]))
    print("never printed")
""")


@pytest.mark.parametrize("code", [0, 3])
def test_after_a_process_group_exit_process_runs_atexit_flushes_and_skips_finalization(tmp_path, code):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), "group", str(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == code
    assert done.stdout == "unflushed output"
    assert "atexit ran" in done.stderr
    assert "finalized" not in done.stderr


def test_without_a_process_group_exit_process_is_a_plain_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), "alone", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 4
    assert done.stdout == "unflushed output"
    assert "atexit ran" in done.stderr
    assert "finalized" in done.stderr


def test_the_dptrain_program_keeps_its_exit_code_for_bad_input(tmp_path):
    done = run_dptrain(["train", "--epochs", "-1", "--out", str(tmp_path / "run")], cwd=os.getcwd(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("dptrain: error:") and "Traceback" not in done.stderr


def test_a_program_that_asked_to_skip_finalization_leaves_without_it_though_it_joined_no_group(tmp_path):
    # dptrain's launcher (`dptrain train --workers 2`) joins no group; it still leaves without tearing torch down.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys
        import dptrain
        import dptrain.runtime.distributed
        from dptrain.exits import skip_finalization

        class Finalized:
            def __del__(self, write=os.write):
                write(2, b"finalized")

        keep = Finalized()
        atexit.register(lambda: print("atexit ran", end="", file=sys.stderr))
        skip_finalization()
        dptrain.run(lambda: print("unflushed output", end="") or 5)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (5, "unflushed output")
    assert "atexit ran" in done.stderr and "finalized" not in done.stderr
