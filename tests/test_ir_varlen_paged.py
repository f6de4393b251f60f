"""Serving layouts in the IR: varlen spans (`until`) and paged KV (page-table spans, gathered axes).

(a) varlen prefill over token-major q/k/v/o, (b) vLLM paged decode over a block table,
(c) SGLang token-pool decode over req_to_token, (d) the paged decode with gpt-oss attention sinks (the online
softmax starts at m = sinks[h], l = 1): each round-trips, validates, runs in the interpreter to the per-sequence
torch reference on ragged lengths, and derives its features.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kb.errors import KBError
from kb.ir.evaluate import paged_to_token_major, pool_to_token_major, varlen_attention
from kb.ir.expr import parse_expr as E
from kb.ir.features import derive_features
from kb.ir.interpret import interpret
from kb.ir.nodes import Gather, Init, Load, Span, serving_constructs, walk_stmts
from kb.ir.text import parse_program, print_program, print_stmt_header
from kb.ir.validate import problems, validate
from kb.lower.cuda import lower_program as lower_cuda
from kb.lower.triton import lower_program as lower_triton
from tests.support.ir_programs import FIXTURES, SERVING_TEXTS

HQ, HKV, D = 4, 2, 12  # GQA 2:1, a head dim that is not a power of two
SCALE = 0.3


def _program(name: str):
    return parse_program(SERVING_TEXTS[name])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- text form


@pytest.mark.parametrize("name", sorted(SERVING_TEXTS))
def test_round_trip_and_canonical_text(name: str) -> None:
    p = _program(name)
    assert parse_program(print_program(p)) == p
    assert print_program(p) == SERVING_TEXTS[name]  # the fixtures are written canonically


def test_text_spelling_of_the_new_index_forms() -> None:
    p = _program("pool_decode")
    kt = next(st for st in walk_stmts(p.kernels[0].body) if isinstance(st, Load) and st.out == "kt")
    assert kt.index[0] == Gather("j", "BLOCK_N", E("req_to_token[b, n_start + j]"), E("n_start + j < kv_len"))
    q = _program("varlen_prefill")
    qt = next(st for st in walk_stmts(q.kernels[0].body) if isinstance(st, Load) and st.out == "qt")
    assert qt.index[0] == Span(E("q0 + m_start"), "BLOCK_M", E("q0 + q_len"))
    ungated = dataclasses.replace(kt, index=(dataclasses.replace(kt.index[0], valid=None),) + kt.index[1:])
    assert print_stmt_header(ungated) == "load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N)], hk, :]"
    assert parse_program(SERVING_TEXTS["pool_decode"].replace(print_stmt_header(kt), print_stmt_header(ungated))) \
        .kernels[0].body[-4].body[0] == ungated


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_existing_programs_print_as_before(name: str) -> None:
    p = FIXTURES[name]()
    assert " until " not in print_program(p) and serving_constructs(p) == ()


@pytest.mark.parametrize("bad, where", [
    ("load kt = k[[req_to_token[b, j] for j in range(BLOCK_N) if], hk, :]", "column"),
    ("load kt = k[[req_to_token[b, j] for 3 in range(BLOCK_N)], hk, :]", "lane variable"),
    ("load kt = k[n_start:+BLOCK_N until, hk, :]", "column"),
])
def test_parse_errors_carry_position(bad: str, where: str) -> None:
    text = SERVING_TEXTS["pool_decode"].replace(
        "    load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if n_start + j < kv_len], hk, :]", "    " + bad)
    with pytest.raises(KBError, match=r"^line \d+, column \d+:.*") as err:
        parse_program(text)
    assert where in str(err.value)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("name", sorted(SERVING_TEXTS))
def test_programs_validate(name: str) -> None:
    validate(_program(name))


_KT = "load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if n_start + j < kv_len], hk, :]"


@pytest.mark.parametrize("replacement, message", [
    ("load kt = k[[req_to_token[b, n_start + b] for b in range(BLOCK_N)], hk, :]", "'b' shadows"),
    ("load kt = k[[req_to_token[b, n_start + i] for j in range(BLOCK_N)], hk, :]", "undefined name 'i'"),
    ("load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if j < nope], hk, :]", "undefined name 'nope'"),
    ("load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if n_start + j], hk, :]", "boolean"),
    ("load kt = k[[req_to_token[b, n_start + j] / 2 for j in range(BLOCK_N)], hk, :]", "integer"),
    ("load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_X)], hk, :]", "span size"),
    ("load kt = k[[req_to_token[b, n_start + j] for Hq in range(BLOCK_N)], hk, :]", "'Hq' shadows"),
    ("load kt = k[[qt for j in range(BLOCK_N)], hk, :]", "tile 'qt'"),
    ("load kt = k[n_start:+BLOCK_N until kv_len * sm_scale, hk, :]", "integer"),
    ("load kt = k[n_start:+BLOCK_N until kv_len, hk, 0:+BLOCK_M]", "shape mismatch"),
])
def test_validator_rejects_malformed_forms(replacement: str, message: str) -> None:
    text = SERVING_TEXTS["pool_decode"].replace(_KT, replacement)
    found = "\n".join(str(x) for x in problems(parse_program(text)))
    assert message in found, found


def test_lane_variable_is_local_to_its_index() -> None:
    text = SERVING_TEXTS["pool_decode"].replace("    dot s = qt @ trans(kt)", "    let bad = j\n    dot s = qt @ trans(kt)")
    assert "undefined name 'j'" in "\n".join(str(x) for x in problems(parse_program(text)))


# ---------------------------------------------------------------- execution vs the torch reference


def _cumsum(lens: list[int]) -> list[int]:
    return [sum(lens[:i]) for i in range(len(lens))]


def test_varlen_prefill_matches_reference() -> None:
    torch.manual_seed(0)
    lens = [1, 13, 16, 21, 0]  # length 1, ragged against BLOCK_M=16 / BLOCK_N=8, one block exactly, empty
    T = sum(lens)
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    starts = _cumsum(lens)
    res = interpret(_program("varlen_prefill"), {
        "q": q, "k": k, "v": v, "b_start_loc": torch.tensor(starts, dtype=torch.int32),
        "b_seq_len": torch.tensor(lens, dtype=torch.int32), "sm_scale": SCALE, "max_seq_len": max(lens)})
    o, lse = varlen_attention(q, k, v, starts, lens, starts, lens, sm_scale=SCALE, causal=True)
    _close(res.outputs["o"], o)
    _close(res.outputs["lse"], lse)


def _decode_inputs(kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B = len(kv_lens)
    q = torch.randn(B, HQ, D)
    k_tm, v_tm = torch.randn(sum(kv_lens), HKV, D), torch.randn(sum(kv_lens), HKV, D)
    return q, k_tm, v_tm


def _decode_reference(q: torch.Tensor, k_tm: torch.Tensor, v_tm: torch.Tensor, kv_lens: list[int]):
    B = len(kv_lens)
    return varlen_attention(q, k_tm, v_tm, list(range(B)), [1] * B, _cumsum(kv_lens), kv_lens,
                            sm_scale=SCALE, causal=True)


def test_paged_decode_matches_reference() -> None:
    torch.manual_seed(1)
    page, kv_lens = 8, [1, 8, 13, 30]
    pages_per_seq = [-(-n // page) for n in kv_lens]
    num_pages = sum(pages_per_seq) + 3
    perm = torch.randperm(num_pages).tolist()
    table = torch.zeros(len(kv_lens), 5, dtype=torch.int32)
    k, v = torch.randn(num_pages, page, HKV, D), torch.randn(num_pages, page, HKV, D)
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q = torch.randn(len(kv_lens), HQ, D)
    res = interpret(_program("paged_decode"), {"q": q, "k": k, "v": v, "block_table": table,
                                               "seq_lens": torch.tensor(kv_lens, dtype=torch.int32), "sm_scale": SCALE})
    k_tm, starts = paged_to_token_major(k, table, kv_lens)
    v_tm, _ = paged_to_token_major(v, table, kv_lens)
    o, lse = _decode_reference(q, k_tm, v_tm, kv_lens)
    _close(res.outputs["o"], o)
    _close(res.outputs["lse"], lse)
    stats = res.stats.kernel("decode")  # no dim N: the dense count is the loop's own (one page per block)
    assert stats.kv_blocks_visited == stats.kv_blocks_dense == HQ * sum(pages_per_seq)


def test_pool_decode_matches_reference() -> None:
    torch.manual_seed(2)
    kv_lens = [1, 0, 13, 30, 8]  # an empty sequence: o = 0, lse = -inf
    pool = sum(kv_lens) + 5
    rows = torch.randperm(pool)
    req_to_token = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int32)  # MAX_CTX == 30: lanes past it clamp
    for b, start in enumerate(_cumsum(kv_lens)):
        req_to_token[b, :kv_lens[b]] = rows[start:start + kv_lens[b]]
    k, v = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
    q = torch.randn(len(kv_lens), HQ, D)
    res = interpret(_program("pool_decode"), {"q": q, "k": k, "v": v, "req_to_token": req_to_token,
                                              "seq_lens": torch.tensor(kv_lens, dtype=torch.int32), "sm_scale": SCALE})
    k_tm, _ = pool_to_token_major(k, req_to_token, kv_lens)
    v_tm, _ = pool_to_token_major(v, req_to_token, kv_lens)
    o, lse = _decode_reference(q, k_tm, v_tm, kv_lens)
    _close(res.outputs["o"], o)
    _close(res.outputs["lse"], lse)
    assert bool((res.outputs["o"][1] == 0).all()) and bool(torch.isneginf(res.outputs["lse"][1]).all())


def _paged(kv_lens: list[int], page: int, max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v caches [NUM_PAGES, page, HKV, D] and a block table [B, max_pages] listing each sequence's pages once."""
    pages = [-(-n // page) for n in kv_lens]
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages).tolist()
    table = torch.zeros(len(kv_lens), max_pages, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    return torch.randn(num_pages, page, HKV, D), torch.randn(num_pages, page, HKV, D), table


def test_paged_decode_with_sinks_matches_a_sink_column_reference() -> None:
    torch.manual_seed(4)
    page, kv_lens = 8, [0, 1, 13, 30]  # an empty sequence: every key masked, only the sink is left (o = 0)
    k, v, table = _paged(kv_lens, page, 4)
    q, sinks = torch.randn(len(kv_lens), HQ, D), torch.linspace(-2.0, 3.0, HQ)
    res = interpret(_program("paged_decode_sinks"), {"q": q, "k": k, "v": v, "block_table": table, "sinks": sinks,
                                                     "seq_lens": torch.tensor(kv_lens, dtype=torch.int32), "sm_scale": SCALE})
    for b, n in enumerate(kv_lens):  # the spec's form: cat the sink column into the scores, softmax, drop it
        kk = k[table[b].long()].flatten(0, 1)[:n].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [HQ, n, D]
        vv = v[table[b].long()].flatten(0, 1)[:n].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        s = torch.cat([(q[b][:, None, :] @ kk.transpose(1, 2))[:, 0] * SCALE, sinks[:, None]], dim=-1)  # [HQ, n + 1]
        _close(res.outputs["o"][b], (s.softmax(-1)[:, :-1, None] * vv).sum(1))
        _close(res.outputs["lse"][b], torch.logsumexp(s, dim=-1))  # the sink is in the denominator
    assert bool((res.outputs["o"][0] == 0).all()) and torch.equal(res.outputs["lse"][0], sinks)


@pytest.mark.parametrize("fill, message", [
    ("(1.0)", "is a constant; write the number itself"),
    ("sinks[h] > 0.0", "must be a number, not a condition"),
    ("sinks[hh]", "undefined name 'hh'"),
    ("qt", "tile 'qt' used where a scalar is needed"),
])
def test_validator_rejects_bad_fill_expressions(fill: str, message: str) -> None:
    text = SERVING_TEXTS["paged_decode_sinks"].replace("full(1; sinks[h])", f"full(1; {fill})")
    found = "\n".join(str(x) for x in problems(parse_program(text)))
    assert message in found, found


def test_init_fill_parses_numbers_as_numbers_and_the_rest_as_expressions() -> None:
    inits = {st.out: st.fill for st in walk_stmts(_program("paged_decode_sinks").kernels[0].body) if isinstance(st, Init)}
    assert inits == {"m_i": E("sinks[h]"), "l_i": 1.0, "acc": 0.0}
    text = SERVING_TEXTS["paged_decode_sinks"].replace("full(1; sinks[h])", "full(1; maximum(sinks[h], -1.0e4) * 2.0)")
    assert parse_program(print_program(parse_program(text))) == parse_program(text)
    with pytest.raises(KBError, match=r"^line 17, column \d+:"):
        parse_program(SERVING_TEXTS["paged_decode_sinks"].replace("full(1; sinks[h])", "full(1; sinks[h] +)"))


def test_reference_bottom_right_causal_and_window() -> None:
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    o, lse = varlen_attention(q, k, v, [0], [3], [0], [5], sm_scale=1.0, causal=True, window=2)
    s = (q[:, 0] @ k[:, 0].T)
    allowed = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)  # keys 2+i-1 .. 2+i
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v[:, 0]
    _close(o[:, 0], want)
    _close(lse[:, 1], torch.logsumexp((q[:, 1] @ k[:, 0].T).masked_fill(~allowed, float("-inf")), dim=-1))


def test_gathered_lane_out_of_table_range_is_an_error() -> None:
    p = parse_program(SERVING_TEXTS["pool_decode"].replace(" if n_start + j < kv_len]", "]"))
    inputs = {"q": torch.randn(1, HQ, D), "k": torch.randn(16, HKV, D), "v": torch.randn(16, HKV, D),
              "req_to_token": torch.zeros(1, 5, dtype=torch.int32), "seq_lens": torch.tensor([5], dtype=torch.int32),
              "sm_scale": SCALE}
    with pytest.raises(KBError, match="gathered index reads req_to_token out of range"):
        interpret(p, inputs)


# ---------------------------------------------------------------- features and lowerings


@pytest.mark.parametrize("name, varlen, paged, sinks", [
    ("varlen_prefill", True, False, False), ("paged_decode", False, True, False), ("pool_decode", False, True, False),
    ("paged_decode_sinks", False, True, True),
])
def test_features(name: str, varlen: bool, paged: bool, sinks: bool) -> None:
    f = derive_features(_program(name))
    assert (f.varlen, f.paged_kv, f.sinks) == (varlen, paged, sinks)
    assert ("sinks" in f.describe()) == sinks


@pytest.mark.parametrize("name, construct", [("varlen_prefill", "`until` (on q, k, v, o, lse)"),
                                             ("pool_decode", "a gathered axis (on k, v)")])
def test_cuda_lowering_refuses_until_and_gather(name: str, construct: str) -> None:
    with pytest.raises(KBError, match="not supported yet") as err:
        lower_cuda(_program(name))  # the Triton lowering runs them (tests/test_lower_serving.py)
    assert construct in str(err.value)


def test_cuda_lowering_refuses_token_major_paged_decode() -> None:
    with pytest.raises(KBError, match=r"q must be \[B, H, S, D\]"):
        lower_cuda(_program("paged_decode"))


def test_lowerings_refuse_an_init_filled_by_an_expression() -> None:
    p = FIXTURES["plain"]()
    sinks = dataclasses.replace(p, params=p.params + (dataclasses.replace(p.param("sm_scale"), name="sink"),),
                                kernels=tuple(dataclasses.replace(k, body=tuple(
                                    dataclasses.replace(st, fill=E("sink")) if isinstance(st, Init) and st.out == "m_i"
                                    else st for st in k.body)) for k in p.kernels))
    validate(sinks)
    with pytest.raises(KBError, match=r"does not support an init filled by an expression \(attention sinks\)"):
        lower_triton(sinks)
