"""Launch constants are read as an NVIDIA GPU runs the launcher: another vendor's branches left out, special cases
(a branch on a shape or flag) never overriding what the unconditional path sets."""

from __future__ import annotations

from pathlib import Path

from ingest.triton_source import parse_module

LAUNCHER = '''\
import triton
import triton.language as tl

is_hip_ = False


@triton.jit
def kern(X, BLOCK_N: tl.constexpr):
    pass


def launch(x, head_dim, group):
    BLOCK = 32
    if is_hip_:
        BLOCK = 16
    num_stages = 2
    if is_hip_:
        num_stages = 1
    elif not is_hip_ and head_dim >= 1024:
        num_stages = 1
    if group == 1:
        num_warps = 4
    else:
        num_warps = 2
        if is_hip_:
            num_warps = 1
    TILE = 64 if not is_hip_ else 8
    WIDE = 4 if head_dim <= 64 else 8
    kern[(1,)](x, BLOCK_N=BLOCK, num_warps=num_warps, num_stages=num_stages, TILE=TILE, WIDE=WIDE)
'''


def test_launch_constants_follow_the_nvidia_path(tmp_path: Path) -> None:
    path = tmp_path / "launcher.py"
    path.write_text(LAUNCHER)
    (site,) = parse_module(path, "launcher.py").launches
    c = site.constants
    assert c["BLOCK_N"] == 32  # not the `if is_hip_:` 16
    assert c["num_stages"] == 2  # neither the AMD 1 nor the head_dim >= 1024 special case
    assert c["num_warps"] == 2  # set only in branches on a flag: the last one, never the AMD one
    assert c["TILE"] == 64  # `64 if not is_hip_ else 8`
    assert "WIDE" not in c and site.keyword_exprs["WIDE"] == "WIDE"  # a shape decides it: left to the expression


def test_only_whole_vendor_words_decide_a_branch(tmp_path: Path) -> None:
    path = tmp_path / "launcher.py"
    path.write_text(LAUNCHER.replace("    TILE = 64 if not is_hip_ else 8\n", "    if has_input:\n        TILE = 8\n"))
    (site,) = parse_module(path, "launcher.py").launches
    assert site.constants["TILE"] == 8  # `has_input` is a flag (the only value there is), not an NPU check
