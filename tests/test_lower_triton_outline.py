"""A split loop's body as one helper: its interface read off its text, and its IS_FULL branches merged."""

from __future__ import annotations

from kb.lower.triton_outline import body_interface, merge_branches


def test_reads_before_writes_are_arguments_and_assigned_arguments_are_returned() -> None:
    body = [
        "    offs = n_start + tl.arange(0, BLOCK_N)",
        "    kt = tl.load(k_ptr + offs[:, None] * stride_k_2)",
        "    qk = tl.dot(qt, tl.trans(kt))",
        "    if IS_FULL:",
        "        pass",
        "    else:",
        "        qk = tl.where(offs[None, :] < N, qk, float('-inf'))",
        "    m_new = tl.maximum(m_i, tl.max(qk, 1))",
        "    acc = tl.dot(qk.to(kt.dtype), kt, acc)",
        "    l_i += tl.sum(qk, 1)",
        "    _tmp = _floordiv(m_new, 2)",  # a preamble function is the module's, not an argument
        "    m_i = m_new",
    ]
    iface = body_interface(body)
    assert iface.params == ("n_start", "BLOCK_N", "k_ptr", "stride_k_2", "qt", "IS_FULL", "N", "m_i", "acc", "l_i")
    assert iface.returns == ("acc", "l_i", "m_i")  # in the order the body first assigns them


def test_a_name_bound_in_both_branches_is_bound_after_them() -> None:
    iface = body_interface(["    if IS_FULL:", "        x = a", "    else:", "        x = b", "    y = x + 1"])
    assert iface.params == ("IS_FULL", "a", "b") and iface.returns == ()


def test_adjacent_branches_merge_and_a_branch_without_code_is_left_out() -> None:
    lines = [
        "    o = n + tl.arange(0, B)",
        "    if IS_FULL:",
        "        kt = tl.load(p + o)",
        "    else:",
        "        kt = tl.load(p + o, mask=o < N)",
        "    if IS_FULL:",
        "        vt = tl.load(q + o)",
        "    else:",
        "        vt = tl.load(q + o, mask=o < N)",
        "    s = kt * vt",
        "    if IS_FULL:",
        "        # full block: no mask",
        "        pass",
        "    else:",
        "        s = tl.where(o < N, s, 0.0)",
    ]
    assert merge_branches(lines) == [
        "    o = n + tl.arange(0, B)",
        "    if IS_FULL:",
        "        kt = tl.load(p + o)",
        "        vt = tl.load(q + o)",
        "    else:",
        "        kt = tl.load(p + o, mask=o < N)",
        "        vt = tl.load(q + o, mask=o < N)",
        "    s = kt * vt",
        "    # full block: no mask",
        "    if not IS_FULL:",
        "        s = tl.where(o < N, s, 0.0)",
    ]
