"""`dptrain run` and `dptrain train` tag each worker's output line with "[rankN] "; torch tags some of its own
lines (C++ warnings and logs) with "[rankN]:" already. The worker's line then carries one tag, ours."""

from dptrain.runtime.spawn import _prefixed


def test_a_line_torch_already_tagged_with_the_same_rank_keeps_one_tag():
    torch_line = b"[rank1]:[W1204 18:20:01.000000000 ProcessGroupGloo.cpp:727] Warning: an example\n"
    assert _prefixed(torch_line, b"[rank1] ") == (
        b"[rank1] [W1204 18:20:01.000000000 ProcessGroupGloo.cpp:727] Warning: an example\n")


def test_only_a_leading_tag_of_the_same_rank_is_dropped():
    data = b"[rank0]:from another rank\nsays [rank1]: in the middle\n[rank1] our own style, kept\n[rank12]:x\n"
    assert _prefixed(data, b"[rank1] ") == (b"[rank1] [rank0]:from another rank\n"
                                            b"[rank1] says [rank1]: in the middle\n"
                                            b"[rank1] [rank1] our own style, kept\n"
                                            b"[rank1] [rank12]:x\n")


def test_a_prefix_that_is_no_rank_tag_changes_nothing_in_the_lines():
    assert _prefixed(b">:a\n[rank1]:b\n", b"> ") == b"> >:a\n> [rank1]:b\n"
