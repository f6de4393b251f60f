"""Constants of traced variant expressions written back in dims: from two (or three) traces of one spec at other
lengths or head counts, a constant that follows the dim becomes an expression in it; anything else is left alone."""

from __future__ import annotations

from generate.spec_generalize import generalize, generalize_heads, generalize_sizes
from kb.ir.expr import parse_expr, print_expr


def _heads(a: str, b: str, h1: tuple[int, int] = (4, 2), h2: tuple[int, int] = (8, 4)) -> tuple[bool, str]:
    ok, e = generalize_heads(parse_expr(a), parse_expr(b), h1, h2)
    return ok, print_expr(e) if e is not None else ""


def test_a_constant_equal_to_the_head_count_is_hq_or_hkv() -> None:
    assert _heads("score + exp2((h + 1) * -8.0 / 4) * (kv_idx - q_idx)", "score + exp2((h + 1) * -8.0 / 8) * (kv_idx - q_idx)") \
        == (True, "score + exp2((h + 1) * -8.0 / Hq) * (kv_idx - q_idx)")
    assert _heads("score + h // 2", "score + h // 4") == (True, "score + h // Hkv")


def test_a_folded_constant_becomes_a_multiple_or_quotient_of_hq() -> None:
    assert _heads("score * exp2(-2.0 * (h + 1))", "score * exp2(-1.0 * (h + 1))") == (True, "score * exp2(-8.0 / Hq * (h + 1))")
    assert _heads("score + 0.5", "score + 1.0") == (True, "score + 0.125 * Hq")


def test_what_no_expression_in_the_heads_gives_is_refused() -> None:
    assert _heads("score / 4", "score / 6")[0] is False  # 4 -> 6 at 4 -> 8 heads: not Hq, not a multiple
    assert _heads("score + 1", "tanh(score)")[0] is False  # another structure
    assert _heads("score / 3", "score / 3") == (True, "score / 3")  # unchanged: a constant


def test_lengths_become_m_and_n() -> None:
    e = generalize(parse_expr("kv_idx <= q_idx + 128"), parse_expr("kv_idx <= q_idx + 130"), (64, 192), (67, 197))
    assert e is not None and print_expr(e) == "kv_idx <= q_idx + (N - M)"


def _sizes(a: str, b: str, s1: dict[str, int], s2: dict[str, int]) -> tuple[bool, str]:
    ok, e = generalize_sizes(parse_expr(a), parse_expr(b), s1, s2)
    return ok, print_expr(e) if e is not None else ""


def test_an_offset_into_a_table_follows_the_tables_size() -> None:
    """A constructor's max_len sizes a table of 2 * max_len - 1 columns read at i - j + max_len - 1."""
    assert _sizes("score + t[h, q_idx - kv_idx + 143]", "score + t[h, q_idx - kv_idx + 144]", {"t_n0": 4, "t_n1": 287},
                  {"t_n0": 4, "t_n1": 289}) == (True, "score + t[h, q_idx - kv_idx + (t_n1 - 1) // 2]")
    assert _sizes("score + t[kv_idx] * 7", "score + t[kv_idx] * 9", {"t_n0": 7}, {"t_n0": 9})[0] is False  # bare index
    assert _sizes("score + t[q_idx - kv_idx + 10]", "score + t[q_idx - kv_idx + 30]", {"t_n0": 21},
                  {"t_n0": 23})[0] is False  # moves by 20 where the table grew by 2
