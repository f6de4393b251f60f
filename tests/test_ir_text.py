"""IR text form: exact round trip, golden files, comments, positioned parse errors, content hash."""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from kb.errors import KBError
from kb.ir.expr import CALLS, Expr, ExprOp, const, load, var
from kb.ir.nodes import (
    MASK_MOD_PARAMS, SCORE_MOD_PARAMS, BlockClass, Dot, Dtype, For, IfBlock, Init, Let, Load, Mask,
    Program, Schedule, Span, TileAt, VariantFn,
)
from kb.ir.text import content_hash, parse_program, print_program
from tests.support.ir_programs import FIXTURES, all_fixtures, causal

GOLDEN = Path(__file__).parent / "golden" / "ir"
DOC = Path(__file__).parents[1] / "docs" / "ir.md"
# read at import: conftest's autouse fixture clears every KB_* variable before each test runs
UPDATE_GOLDEN = os.environ.get("KB_UPDATE_GOLDEN") == "1"


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_round_trip(name: str, dtype: Dtype) -> None:
    p = FIXTURES[name](dtype=dtype)
    text = print_program(p)
    assert parse_program(text) == p
    assert print_program(parse_program(text)) == text  # printing is a fixed point


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_golden_text(name: str) -> None:
    """Printed text of each fixture; regenerate with KB_UPDATE_GOLDEN=1 after an intended change."""
    path = GOLDEN / f"{name}.kbir"
    text = print_program(FIXTURES[name]())
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with KB_UPDATE_GOLDEN=1"
    assert text == path.read_text()
    assert parse_program(path.read_text()) == FIXTURES[name]()


def test_doc_example_is_the_causal_fixture() -> None:
    """The annotated example in docs/ir.md (with comments and alignment) parses to the fixture."""
    block = re.search(r"```\n(program causal\n.*?)```", DOC.read_text(), re.S)
    assert block is not None
    assert parse_program(block.group(1)) == causal()


def test_comments_and_blank_lines_are_ignored() -> None:
    p = all_fixtures()["decode_split_kv"]
    lines = print_program(p).splitlines()
    noisy = ["# a leading comment", ""]
    for i, ln in enumerate(lines):
        noisy.append(f"{ln}   # note {i}")
        if i % 3 == 0:
            noisy += ["", "    # an indented comment line", "   "]
    assert parse_program("\n".join(noisy)) == p
    assert parse_program("\r\n".join(lines)) == p


# ---------------------------------------------------------------- random programs

_VARS = ("b", "h", "m_start", "n_start", "q_idx", "kv_idx", "score", "BLOCK_N", "N", "softcap")
_BIN = [op for op in ExprOp if op.value in {"+", "-", "*", "/", "//", "%", "<", "<=", ">", ">=", "==", "!=", "&", "|"}]
_FLOATS = (0.0, -0.0, 1.5, -2.25, 1e-300, 3.141592653589793, 1e16, -math.inf, math.inf, 0.1 + 0.2)


def _rand_leaf(rng: random.Random) -> Expr:
    kind = rng.randrange(4)
    if kind == 0:
        return var(rng.choice(_VARS))
    if kind == 1:
        return const(rng.randint(-5, 1 << 40))
    if kind == 2:
        return const(rng.choice(_FLOATS))
    return const(rng.random() < 0.5)


def _rand_expr(rng: random.Random, depth: int = 4) -> Expr:
    if depth == 0 or rng.random() < 0.25:
        return _rand_leaf(rng)
    kind = rng.randrange(5)
    if kind == 0:
        return Expr(rng.choice(_BIN), (_rand_expr(rng, depth - 1), _rand_expr(rng, depth - 1)))
    if kind == 1:
        inner = _rand_expr(rng, depth - 1)
        # `-3` parses as the constant -3 (see report): negate only non-constant operands
        op = ExprOp.NOT if inner.op is ExprOp.CONST or rng.random() < 0.5 else ExprOp.NEG
        return Expr(op, (inner,))
    if kind == 2:
        name = rng.choice(sorted(CALLS))
        return Expr(CALLS[name][0], tuple(_rand_expr(rng, depth - 1) for _ in range(CALLS[name][1])))
    if kind == 3:
        return load(rng.choice(("slopes", "doc_ids", "bias")), *(_rand_expr(rng, depth - 1) for _ in range(rng.randint(1, 3))))
    return _rand_leaf(rng)


def _rand_stmt_change(st, rng: random.Random):
    e = lambda: _rand_expr(rng, 3)  # noqa: E731
    match st:
        case Let():
            return replace(st, value=e(), name=st.name + "_x")
        case Load():
            index = tuple(Span(e(), rng.choice(("BLOCK_M", 32))) if isinstance(ix, Span) else ix for ix in st.index)
            return replace(st, index=index, other=rng.choice(_FLOATS))
        case Init():
            return replace(st, fill=rng.choice(_FLOATS), dtype=rng.choice(list(Dtype)), shape=st.shape + (rng.randint(1, 9),))
        case Dot():
            return replace(st, trans_b=not st.trans_b)
        case Mask():
            return replace(st, use_mask_mod=not st.use_mask_mod, at=replace(st.at, kv_start=e()))
        case For():
            return replace(st, order=rng.choice(("forward", "reverse")), step=rng.choice(("BLOCK_N", 8)), lo=e(), hi=e(),
                           body=_perturb_block(st.body, rng))
        case IfBlock():
            return replace(st, cls=rng.choice(list(BlockClass)), negate=not st.negate,
                           orelse=st.orelse or _perturb_block(st.then, rng), then=_perturb_block(st.then, rng))
    return st


def _perturb_block(body: tuple, rng: random.Random) -> tuple:
    out = [(_rand_stmt_change(st, rng) if rng.random() < 0.5 else st) for st in body]
    if rng.random() < 0.3:
        out.insert(rng.randrange(len(out) + 1), IfBlock(rng.choice(list(BlockClass)), rng.random() < 0.5,
                                                         TileAt(var("b"), var("h"), _rand_expr(rng, 2), var("n_start")),
                                                         then=tuple(out[:2]), orelse=tuple(out[-1:])))
    return tuple(out)


def _perturb(p: Program, rng: random.Random) -> Program:
    sched = Schedule(**{f.name: (rng.choice((True, False)) if f.type == "bool" else
                                 rng.choice(("forward", "reverse")) if f.type == "str" else rng.randint(-3, 256))
                        for f in fields(Schedule)})
    params = tuple(replace(prm, dtype=rng.choice(list(Dtype)), shape=prm.shape + ((7,) if rng.random() < 0.2 else ()))
                   for prm in p.params)
    variants = {}
    for slot in ("score_mod", "mask_mod"):
        fn = getattr(p, slot)
        if fn is not None or rng.random() < 0.5:
            variants[slot] = VariantFn(slot, SCORE_MOD_PARAMS if slot == "score_mod" else MASK_MOD_PARAMS, _rand_expr(rng))
    kernels = tuple(replace(k, body=_perturb_block(k.body, rng)) for k in p.kernels)
    return replace(p, name=p.name + "_r", params=params, schedule=sched, kernels=kernels, **variants)


def test_random_perturbations_round_trip() -> None:
    rng = random.Random(20240601)
    fixtures = list(all_fixtures().values())
    for _ in range(300):
        p = _perturb(rng.choice(fixtures), rng)
        text = print_program(p)
        assert parse_program(text) == p, text
        assert content_hash(parse_program(text)) == content_hash(p)


# ---------------------------------------------------------------- errors


def _err(text: str) -> str:
    with pytest.raises(KBError) as info:
        parse_program(text)
    return str(info.value)


def _causal_lines() -> list[str]:
    return print_program(causal()).splitlines()


def _with_line(i: int, new: str) -> str:
    lines = _causal_lines()
    lines[i] = new
    return "\n".join(lines)


def _line_of(prefix: str) -> int:
    return next(i for i, ln in enumerate(_causal_lines()) if ln.strip().startswith(prefix))


def test_error_bad_indentation() -> None:
    i = _line_of("let hk")
    msg = _err(_with_line(i, "   let hk = h // (Hq // Hkv)"))
    assert msg.startswith(f"line {i + 1}, column 4:") and "indentation" in msg


def test_error_unexpected_indentation() -> None:
    i = _line_of("let m_start")
    msg = _err(_with_line(i, "    let m_start = m * BLOCK_M"))
    assert msg.startswith(f"line {i + 1}, column 5:") and "unexpected indentation" in msg


def test_error_tab_indentation() -> None:
    i = _line_of("let hk")
    assert "tab" in _err(_with_line(i, "\tlet hk = h // (Hq // Hkv)"))


def test_error_unknown_statement() -> None:
    i = _line_of("dot s")
    msg = _err(_with_line(i, "    matmul s = qt @ trans(kt)"))
    assert msg.startswith(f"line {i + 1}, column 5: unknown statement 'matmul'")


def test_error_malformed_statement_names_the_form() -> None:
    i = _line_of("dot s")
    msg = _err(_with_line(i, "    dot s = qt * kt"))
    assert msg.startswith(f"line {i + 1}, column 5: malformed dot statement") and "trans(B)" in msg


def test_error_unknown_schedule_key() -> None:
    i = _line_of("schedule")
    msg = _err(_with_line(i, "schedule block_m=16 blockn=16"))
    assert msg.startswith(f"line {i + 1}, column 21: unknown schedule key 'blockn'")


def test_error_bad_schedule_value() -> None:
    i = _line_of("schedule")
    assert "takes an integer" in _err(_with_line(i, "schedule block_m=big"))
    assert "given twice" in _err(_with_line(i, "schedule block_m=16 block_m=32"))


def test_error_expression_carries_position() -> None:
    i = _line_of("elementwise s")
    msg = _err(_with_line(i, "    elementwise s = s * frob(sm_scale)"))
    # column of `frob(` in the line: 5 (indent) + len("elementwise s = s * ")
    assert msg.startswith(f"line {i + 1}, column {5 + len('elementwise s = s * ')}:") and "unknown function frob" in msg


def test_error_index_expression_position() -> None:
    i = _line_of("load kt")
    msg = _err(_with_line(i, "    load kt = k[b, hk, n_start:+BLOCK_N, :, ??]"))
    assert msg.startswith(f"line {i + 1}, column") and "cannot parse expression" in msg


def test_error_unknown_dtype_and_role() -> None:
    i = _line_of("param q")
    assert "unknown dtype 'fp8'" in _err(_with_line(i, "param q: [B, Hq, M, D] fp8 in"))
    assert "unknown role 'input'" in _err(_with_line(i, "param q: [B, Hq, M, D] f32 input"))


def test_error_structure() -> None:
    lines = _causal_lines()
    assert "expected 'program NAME'" in _err("\n".join(lines[1:]))
    assert "before 'schedule'" in _err("\n".join(ln for ln in lines if not ln.startswith("schedule")))
    assert "no kernel" in _err("\n".join(lines[:_line_of("kernel")]))
    assert "expected an indented block" in _err("\n".join(lines[:_line_of("kernel") + 1]))
    assert "'else:' without" in _err(_with_line(_line_of("let m_start"), "  else:"))
    assert "after line" in _err(_with_line(_line_of("online_softmax"), "    else:"))  # else with no block
    j = _line_of("param o")
    moved = lines[:j] + lines[j + 1:_line_of("kernel")] + [lines[j]] + lines[_line_of("kernel"):]
    assert "out of order" in _err("\n".join(moved))
    assert "empty program" in _err("# nothing\n\n")


def test_error_nan_rejected() -> None:
    i = _line_of("init l_i")
    assert "NaN" in _err(_with_line(i, "  init l_i = full(BLOCK_M; nan) f32"))


# ---------------------------------------------------------------- content hash


def test_content_hash_is_identity() -> None:
    progs = all_fixtures()
    hashes = {name: content_hash(p) for name, p in progs.items()}
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes.values())
    assert len(set(hashes.values())) == len(hashes)
    assert content_hash(causal()) == hashes["causal"]  # rebuilt program, same identity
    assert content_hash(causal(Dtype.BF16)) != hashes["causal"]
    commented = "# header\n" + print_program(causal()).replace("\n", "  # c\n")
    assert content_hash(parse_program(commented)) == hashes["causal"]
    tweaked = replace(causal(), schedule=replace(causal().schedule, num_stages=3))
    assert content_hash(tweaked) != hashes["causal"]


def test_tile_rows_as_heads_round_trip() -> None:
    """`at (b, heads h0, q, kv)`: a grouped decode tile whose row i is query head h0 + i (TileAt.head_rows)."""
    p = FIXTURES["alibi"]()
    text = print_program(p).replace("score_mod s at (b, h, ", "score_mod s at (b, heads h, ")
    assert "heads h" in text
    parsed = parse_program(text)
    placed = [st for k in parsed.kernels for st in k.body if isinstance(st, For) for st in st.body
              if getattr(st, "at", None) is not None and st.at.head_rows]
    assert len(placed) == 1 and placed[0].at.h == var("h")
    assert print_program(parsed) == text and parsed != p
