"""io.atomic_write_bytes with two writers of one path at once: a temporary name shared by every writer of
PATH (PATH.tmp) would let one writer's rename take the other's file, and the second rename fail with 'No such
file or directory'."""

import subprocess
import sys
from pathlib import Path

WRITER = """
import sys
from dptrain.io import atomic_write_bytes
path, mark = sys.argv[1], sys.argv[2].encode()
for _ in range(300):
    atomic_write_bytes(path, mark * 100_000)
"""


def test_two_processes_replacing_one_file_at_once_both_succeed_and_it_is_always_one_whole_write(tmp_path: Path):
    target = tmp_path / "model.pt"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(target), mark], stderr=subprocess.PIPE, text=True)
               for mark in "ab"]
    seen = set()
    while any(writer.poll() is None for writer in writers):
        if target.exists():
            data = target.read_bytes()
            seen.add((data[:1], len(data), len(set(data))))
    errors = [writer.stderr.read() for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], errors
    assert seen <= {(b"a", 100_000, 1), (b"b", 100_000, 1)}, seen  # never half of one, never a mix
    assert target.read_bytes() in (b"a" * 100_000, b"b" * 100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary file left behind
