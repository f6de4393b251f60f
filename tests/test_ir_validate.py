"""IR validator: every fixture passes; each rule catches its kind of bad program, naming the node."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from kb.errors import KBError
from kb.ir.expr import Expr, parse_expr as E
from kb.ir.nodes import (
    BlockClass, Dot, Dtype, Elementwise, For, Full, GridAxis, IfBlock, Let, Load, Mask, OnlineSoftmax,
    Param, Program, Role, Schedule, ScoreMod, Span, Store, TileAt, VariantFn,
)
from kb.ir.text import parse_program, print_program
from kb.ir.validate import PROGRAM_RULES, problems, validate
from tests.support.ir_programs import FIXTURES, alibi, causal, decode_split_kv, plain


def _msg(p: Program) -> str:
    with pytest.raises(KBError) as info:
        validate(p)
    return str(info.value)


def _body(p: Program, k: int = 0) -> tuple:
    return p.kernels[k].body


def _with_body(p: Program, body: tuple, k: int = 0) -> Program:
    kernels = list(p.kernels)
    kernels[k] = replace(kernels[k], body=tuple(body))
    return replace(p, kernels=tuple(kernels))


def _loop_index(p: Program) -> int:
    return next(i for i, st in enumerate(_body(p)) if isinstance(st, For))


def _with_loop_body(p: Program, fn) -> Program:
    body = list(_body(p))
    i = _loop_index(p)
    body[i] = replace(body[i], body=tuple(fn(list(body[i].body))))
    return _with_body(p, body)


def _set(items: list, i: int, value) -> list:
    items[i] = value
    return items


@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixtures_are_valid(name: str, dtype: Dtype) -> None:
    p = FIXTURES[name](dtype=dtype)
    assert problems(p) == ()
    validate(p)
    validate(parse_program(print_program(p)))


def test_program_rules_table() -> None:
    assert len(PROGRAM_RULES) >= 5  # statement rules cover every kind by construction (tests/test_ir_visit.py)


def test_unknown_statement_node() -> None:
    @dataclass(frozen=True)
    class Frob:
        x: int = 1

    msg = _msg(_with_body(plain(), _body(plain()) + (Frob(),)))
    assert "unknown statement kind Frob" in msg and "kernel fwd, statement" in msg


def test_unknown_expression_op() -> None:
    bad = Let("x", Expr(op="plus", args=(E("b"), E("1"))))  # type: ignore[arg-type]
    assert "unknown expression node" in _msg(_with_body(plain(), _body(plain()) + (bad,)))


def test_undefined_scalar_name() -> None:
    p = _with_body(plain(), (Let("x", E("y + 1")),) + _body(plain()))
    msg = _msg(p)
    assert "kernel fwd, statement 1 (let x = y + 1): undefined name 'y'" in msg


def test_tile_used_before_definition() -> None:
    # drop `load kt`: the dot then reads an undefined tile
    p = _with_loop_body(plain(), lambda b: b[1:])
    assert "dot s = qt @ trans(kt)): b 'kt' is not defined" in _msg(p)


def test_tile_used_as_scalar() -> None:
    p = _with_body(plain(), _body(plain())[:3] + (Let("x", E("qt + 1")),) + _body(plain())[3:])
    assert "tile 'qt' used where a scalar is needed" in _msg(p)


def test_load_of_missing_tensor_names_the_statement() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, 0, replace(b[0], tensor="kk")))
    assert "kernel fwd, statement 8 (load kt = kk[b, hk, n_start:+BLOCK_N, :]): tensor 'kk' is not a param" in _msg(p)


def test_store_of_missing_tensor() -> None:
    body = list(_body(plain()))
    body[-1] = replace(body[-1], tensor="lse2")
    msg = _msg(_with_body(plain(), body))
    assert "tensor 'lse2' is not a param" in msg and "out param is never stored" in msg


def test_index_arity_must_match_rank() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, 0, replace(b[0], index=b[0].index[1:])))
    assert "'k' has rank 4 but is indexed with 3 items" in _msg(p)


def test_span_size_must_be_schedule_constant_or_int() -> None:
    span = Span(E("n_start"), "N")
    p = _with_loop_body(plain(), lambda b: _set(b, 0, replace(b[0], index=(E("b"), E("hk"), span, Full()))))
    assert "span size 'N' must be a schedule constant" in _msg(p)
    zero = Span(E("n_start"), 0)
    p = _with_loop_body(plain(), lambda b: _set(b, 0, replace(b[0], index=(E("b"), E("hk"), zero, Full()))))
    assert "span size 0" in _msg(p)


def test_dot_inner_dims_must_agree() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, 2, Dot("s", "qt", "kt", trans_b=False)))
    msg = _msg(p)
    assert "(dot s = qt @ kt): shape mismatch: inner dims of 'qt' [BLOCK_M, HEAD_PAD] and 'kt' [BLOCK_N, HEAD_PAD] disagree" in msg


def test_online_softmax_needs_matching_scores_and_values() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, len(b) - 1, OnlineSoftmax("m_i", "l_i", "acc", "s", "qt")))
    assert "scores 's' [BLOCK_M, BLOCK_N] and values 'qt' [BLOCK_M, HEAD_PAD] disagree" in _msg(p)


def test_elementwise_operands_must_share_shape() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, 3, Elementwise("s", E("s * kt"))))
    assert "shape mismatch: elementwise operands" in _msg(p)


def test_softmax_state_shape_checked() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, len(b) - 1, OnlineSoftmax("acc", "l_i", "m_i", "s", "vt")))
    assert "'acc' is [BLOCK_M, HEAD_PAD], the softmax state needs [BLOCK_M]" in _msg(p)


def test_variant_referencing_missing_tensor() -> None:
    p = alibi()
    p = replace(p, params=tuple(prm for prm in p.params if prm.name != "slopes"))
    assert "score_mod: tensor 'slopes' is not a param" in _msg(p)


def test_variant_referencing_name_outside_scope() -> None:
    p = replace(causal(), mask_mod=VariantFn("mask_mod", causal().mask_mod.params, E("q_idx >= kv_idx + m_start")))
    assert "mask_mod: undefined name 'm_start'" in _msg(p)
    wrong_kind = replace(causal(), mask_mod=VariantFn("score_mod", causal().mask_mod.params, E("q_idx >= kv_idx")))
    assert "holds a 'score_mod' function" in _msg(wrong_kind)


def test_variant_reads_aux_tensors_only() -> None:
    p = replace(causal(), mask_mod=VariantFn("mask_mod", causal().mask_mod.params, E("q[b, h, q_idx, 0] > 0")))
    assert "variant functions read aux tensors only; 'q' is in" in _msg(p)


def test_mask_mod_statement_without_mask_mod() -> None:
    p = _with_loop_body(plain(), lambda b: [replace(st, use_mask_mod=True) if isinstance(st, Mask) else st for st in b])
    assert "mask s at (b, h, m_start, n_start) mask_mod): mask ... mask_mod in a program without a mask_mod" in _msg(p)


def test_score_mod_statement_without_score_mod() -> None:
    sm = ScoreMod("s", TileAt(E("b"), E("h"), E("m_start"), E("n_start")))
    p = _with_loop_body(plain(), lambda b: b[:4] + [sm] + b[4:])
    assert "score_mod statement in a program without a score_mod function" in _msg(p)


def test_tile_coordinates_are_one_record() -> None:
    p = _with_loop_body(plain(), lambda b: [replace(st, at=(E("b"), E("h"), E("m_start"), E("n_start")))
                                            if isinstance(st, Mask) else st for st in b])
    assert "tile coordinates must be a TileAt(b, h, q_start, kv_start)" in _msg(p)


def test_out_params_must_be_stored() -> None:
    p = _with_body(plain(), _body(plain())[:-1])
    assert "param 'lse': out param is never stored" in _msg(p)


def test_store_of_wrong_rank() -> None:
    body = list(_body(plain()))
    body[-1] = replace(body[-1], value="ot")
    assert "tile 'ot' has rank 2 but the store target [BLOCK_M] has rank 1" in _msg(_with_body(plain(), body))


def test_store_into_input_is_rejected() -> None:
    body = list(_body(plain()))
    body[-2] = replace(body[-2], tensor="q")
    assert "'q' is an in param; only out and scratch params are stored" in _msg(_with_body(plain(), body))


def test_for_step_must_be_block_like() -> None:
    for step in ("N", 0, -16):
        body = list(_body(plain()))
        i = _loop_index(plain())
        body[i] = replace(body[i], step=step)
        assert f"loop step {step!r} must be a block size" in _msg(_with_body(plain(), body))


def test_schedule_values_positive_and_powers_of_two() -> None:
    bad = replace(plain(), schedule=Schedule(block_m=0, block_n=48, num_warps=-1, head_pad=96, kv_order="sideways"))
    msg = _msg(bad)
    for needle in ("block_m=0 must be a positive int", "block_n=48 must be a power of two",
                   "num_warps=-1 must be a positive int", "head_pad=96 must be 0 (auto) or a power of two",
                   "kv_order='sideways'"):
        assert needle in msg


def test_tiles_and_scalars_share_one_namespace() -> None:
    # the original decode fixture named its split axis `s`, the score tile's name
    p = decode_split_kv()
    kernels = list(p.kernels)
    kernels[0] = replace(kernels[0], grid=kernels[0].grid[:-1] + (GridAxis("s", E("NUM_SPLITS")),))
    assert "'s' is already a scalar; scalars and tiles share one namespace" in _msg(replace(p, kernels=tuple(kernels)))
    shadow = _with_body(plain(), (Let("N", E("1")),) + _body(plain()))
    assert "'N' shadows a param, dim or schedule constant" in _msg(shadow)


def test_loop_locals_do_not_escape() -> None:
    use_after = Store("o", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"), Full()), "vt")
    p = _with_body(plain(), _body(plain()) + (use_after,))
    assert "value 'vt' is not defined" in _msg(p)


def test_if_branches_define_names_visible_after() -> None:
    body = list(_body(plain()))
    i = _loop_index(plain())
    mk = lambda fill: Elementwise("t", E(f"s * {fill}"))  # noqa: E731
    branch = IfBlock(BlockClass.FULL, False, TileAt(E("b"), E("h"), E("m_start"), E("n_start")), then=(mk(1.0),), orelse=(mk(2.0),))
    loop = body[i]
    new_loop_body = list(loop.body)
    new_loop_body.insert(4, branch)
    new_loop_body[-1] = OnlineSoftmax("m_i", "l_i", "acc", "t", "vt")
    body[i] = replace(loop, body=tuple(new_loop_body))
    validate(_with_body(plain(), body))
    body[i] = replace(loop, body=tuple(new_loop_body[:4] + [replace(branch, orelse=())] + new_loop_body[5:]))
    assert "scores 't' is not defined" in _msg(_with_body(plain(), body))


def test_param_rules() -> None:
    p = replace(plain(), params=plain().params + (Param("q", ("B",), Dtype.F32, Role.AUX), Param("w", (3,), Dtype.F32, Role.SCALAR)))
    msg = _msg(p)
    assert "param 'q': defined twice" in msg and "param 'w': a scalar param has shape []" in msg


def test_kernel_rules() -> None:
    assert "has no kernel" in _msg(replace(plain(), kernels=()))
    k = plain().kernels[0]
    assert "grid has no axis" in _msg(replace(plain(), kernels=(replace(k, grid=()),)))
    bad_axis = replace(k, grid=(GridAxis("b", E("B")), GridAxis("h", E("Hq + m")), GridAxis("m", E("cdiv(M, BLOCK_M)"))))
    assert "kernel fwd, grid axis h: undefined name 'm'" in _msg(replace(plain(), kernels=(bad_axis,)))
    assert "kernel fwd: defined twice" in _msg(replace(plain(), kernels=(k, k)))


def test_validate_reports_every_problem_at_once() -> None:
    p = _with_loop_body(plain(), lambda b: _set(b, 0, replace(b[0], tensor="kk")))
    p = replace(p, schedule=replace(p.schedule, block_m=3))
    msg = _msg(p)
    assert msg.startswith("program plain is not valid IR (2 problems):")
    assert len(problems(p)) == 2


def test_parsed_text_errors_are_located_in_text_terms() -> None:
    text = print_program(plain()).replace("load vt = v[", "load vt = vv[")
    msg = _msg(parse_program(text))
    assert "kernel fwd, statement 9 (load vt = vv[b, hk, n_start:+BLOCK_N, :]): tensor 'vv' is not a param" in msg


def test_names_must_survive_the_expression_syntax() -> None:
    for bad in ("inf", "lambda", "True", "not a name"):
        p = _with_body(plain(), (Let(bad, E("1")),) + _body(plain()))
        assert f"{bad!r} is not a valid name" in _msg(p)


def test_an_unknown_tile_shape_does_not_cascade() -> None:
    p = _with_body(plain(), tuple(replace(st, tensor="qq") if isinstance(st, Load) else st for st in _body(plain())))
    assert [str(x) for x in problems(p)] == [
        "kernel fwd, statement 3 (load qt = qq[b, h, m_start:+BLOCK_M, :]): tensor 'qq' is not a param"]


def test_printed_names_must_be_identifiers() -> None:
    msg = _msg(replace(plain(), name="fa4-sm90", kernels=(replace(plain().kernels[0], name="fwd kernel"),)))
    assert "program 'fa4-sm90': name must be an identifier" in msg and "kernel 'fwd kernel': name must be" in msg


def test_tile_rows_as_heads_only_where_a_variant_is_applied() -> None:
    p = alibi()
    assert problems(_with_loop_body(p, lambda b: [replace(st, at=replace(st.at, head_rows=True))
                                                  if isinstance(st, (Mask, ScoreMod)) else st for st in b])) == ()
    guard = IfBlock(BlockClass.FULL, True, TileAt(E("b"), E("h"), E("m_start"), E("n_start"), head_rows=True),
                    (Let("x", E("1")),))
    assert "tile rows as query heads (`heads h`) only where a score_mod or mask is applied" in \
        _msg(_with_loop_body(p, lambda b: [guard] + b))
