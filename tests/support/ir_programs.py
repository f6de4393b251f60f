"""Hand-written IR programs used as test fixtures (not KB content: KB content comes from ingest).

Each builder returns a complete Program; `FIXTURES` names them all. Shapes are symbolic:
q: [B, Hq, M, D], k/v: [B, Hkv, N, D], o: [B, Hq, M, D], lse: [B, Hq, M].
"""

from __future__ import annotations

from typing import Callable

from kb.ir.expr import Expr, parse_expr as E
from kb.ir.nodes import (
    AuxGrad, BlockClass, Combine, Dot, Dtype, Elementwise, Finalize, For, Full, GridAxis, IfBlock, Init,
    Kernel, Let, Load, Mask, OnlineSoftmax, Param, Probs, Program, Reduce, Role, Schedule, ScoreMod, ScoreModGrad,
    SoftmaxGrad, Span, Store, TileAt, VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS,
)


def _params(dtype: Dtype, aux: tuple[Param, ...] = (), scalars: tuple[str, ...] = ()) -> tuple[Param, ...]:
    return (
        Param("q", ("B", "Hq", "M", "D"), dtype, Role.IN),
        Param("k", ("B", "Hkv", "N", "D"), dtype, Role.IN),
        Param("v", ("B", "Hkv", "N", "D"), dtype, Role.IN),
        Param("o", ("B", "Hq", "M", "D"), dtype, Role.OUT),
        Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.OUT),
        Param("sm_scale", (), Dtype.F32, Role.SCALAR),
        *(Param(s, (), Dtype.F32, Role.SCALAR) for s in scalars),
        *aux,
    )


def _kv_loop_body(*, score_mod: bool, mask_mod: bool, block_classes: bool) -> tuple:
    at = TileAt(E("b"), E("h"), E("m_start"), E("n_start"))
    body: list = [
        Load("kt", "k", (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())),
        Load("vt", "v", (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())),
        Dot("s", "qt", "kt", trans_b=True),
        Elementwise("s", E("s * sm_scale")),
    ]
    if score_mod:
        body.append(ScoreMod("s", at))
    if block_classes:
        # full blocks skip masking entirely; partial ones apply bounds + mask_mod
        body.append(IfBlock(BlockClass.FULL, True, at, then=(Mask("s", at, use_mask_mod=mask_mod),)))
    else:
        body.append(Mask("s", at, use_mask_mod=mask_mod))
    body.append(OnlineSoftmax("m_i", "l_i", "acc", "s", "vt"))
    return tuple(body)


def forward(
    name: str,
    *,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    lo: str = "0",
    hi: str = "N",
    dtype: Dtype = Dtype.F32,
    aux: tuple[Param, ...] = (),
    scalars: tuple[str, ...] = (),
    block_classes: bool = False,
    schedule: Schedule = Schedule(block_m=16, block_n=16, num_warps=4, num_stages=1),
) -> Program:
    """The FlashAttention-2 forward structure with the given variant slots and KV bounds."""
    loop = For("n_start", E(lo), E(hi), "BLOCK_N", "forward",
               _kv_loop_body(score_mod=score_mod is not None, mask_mod=mask_mod is not None, block_classes=block_classes))
    body = (
        Let("hk", E("h // (Hq // Hkv)")),
        Let("m_start", E("m * BLOCK_M")),
        Load("qt", "q", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"), Full())),
        Init("m_i", ("BLOCK_M",), float("-inf"), Dtype.F32),
        Init("l_i", ("BLOCK_M",), 0.0, Dtype.F32),
        Init("acc", ("BLOCK_M", "HEAD_PAD"), 0.0, Dtype.F32),
        loop,
        Finalize("ot", "lt", "m_i", "l_i", "acc"),
        Store("o", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"), Full()), "ot"),
        Store("lse", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M")), "lt"),
    )
    grid = (GridAxis("b", E("B")), GridAxis("h", E("Hq")), GridAxis("m", E("cdiv(M, BLOCK_M)")))
    return Program(
        name=name,
        params=_params(dtype, aux, scalars),
        schedule=schedule,
        kernels=(Kernel("fwd", grid, body),),
        score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, E(score_mod)) if score_mod else None,
        mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, E(mask_mod)) if mask_mod else None,
    )


def plain(dtype: Dtype = Dtype.F32) -> Program:
    return forward("plain", dtype=dtype)


def causal(dtype: Dtype = Dtype.F32) -> Program:
    # top-left aligned causal; block skipping: no KV block past the query block's last row
    return forward("causal", mask_mod="q_idx >= kv_idx", hi="minimum(N, m_start + BLOCK_M)", dtype=dtype,
                   block_classes=True)


def sliding_window(window: int = 24, dtype: Dtype = Dtype.F32) -> Program:
    return forward(
        "sliding_window",
        mask_mod=f"(q_idx >= kv_idx) & (q_idx - kv_idx < {window})",
        lo=f"maximum(0, (m_start - {window - 1}) // BLOCK_N * BLOCK_N)",
        hi="minimum(N, m_start + BLOCK_M)",
        dtype=dtype,
        block_classes=True,
    )


def alibi(dtype: Dtype = Dtype.F32) -> Program:
    return forward(
        "alibi_causal",
        score_mod="score + slopes[h] * (kv_idx - q_idx)",
        mask_mod="q_idx >= kv_idx",
        hi="minimum(N, m_start + BLOCK_M)",
        aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),),
        dtype=dtype,
    )


def softcap(dtype: Dtype = Dtype.F32) -> Program:
    return forward("softcap", score_mod="softcap * tanh(score / softcap)", scalars=("softcap",), dtype=dtype)


def document(dtype: Dtype = Dtype.F32) -> Program:
    return forward(
        "document_causal",
        mask_mod="(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)",
        hi="minimum(N, m_start + BLOCK_M)",
        aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),),
        block_classes=True,
        dtype=dtype,
    )


def gqa(dtype: Dtype = Dtype.F32) -> Program:
    # GQA is in the head mapping `hk = h // (Hq // Hkv)`, shared by every program
    return forward("gqa_causal", mask_mod="q_idx >= kv_idx", hi="minimum(N, m_start + BLOCK_M)", dtype=dtype)


def decode_split_kv(num_splits: int = 3, dtype: Dtype = Dtype.F32, *, score_mod: str | None = None,
                    mask_mod: str | None = None, aux: tuple[Param, ...] = ()) -> Program:
    """Split-KV decode: kernel 1 writes per-split partials, kernel 2 combines them by LSE (masks per element)."""
    # the split axis is named `split`, not `s`: `s` is the score tile, and tiles and scalars share one namespace
    base = forward("decode_split_kv", dtype=dtype, score_mod=score_mod, mask_mod=mask_mod, aux=aux,
                   schedule=Schedule(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits))
    chunk = "cdiv(cdiv(N, NUM_SPLITS), BLOCK_N) * BLOCK_N"
    split_loop = For("n_start", E(f"split * {chunk}"), E(f"minimum(N, (split + 1) * {chunk})"), "BLOCK_N", "forward",
                     _kv_loop_body(score_mod=score_mod is not None, mask_mod=mask_mod is not None, block_classes=False))
    fwd = base.kernels[0]
    part_body = tuple(
        split_loop if isinstance(st, For) else st for st in fwd.body if not isinstance(st, Store)
    ) + (
        Store("o_part", (E("b"), E("h"), E("split"), Span(E("m_start"), "BLOCK_M"), Full()), "ot"),
        Store("lse_part", (E("b"), E("h"), E("split"), Span(E("m_start"), "BLOCK_M")), "lt"),
    )
    part = Kernel("split", fwd.grid + (GridAxis("split", E("NUM_SPLITS")),), part_body)
    combine = Kernel("combine", fwd.grid, (
        Let("m_start", E("m * BLOCK_M")),
        Load("po", "o_part", (E("b"), E("h"), Full(), Span(E("m_start"), "BLOCK_M"), Full())),
        Load("pl", "lse_part", (E("b"), E("h"), Full(), Span(E("m_start"), "BLOCK_M")), other=float("-inf")),
        Combine("ot", "lt", "po", "pl"),
        Store("o", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"), Full()), "ot"),
        Store("lse", (E("b"), E("h"), Span(E("m_start"), "BLOCK_M")), "lt"),
    ))
    scratch = (
        Param("o_part", ("B", "Hq", "NUM_SPLITS", "M", "D"), Dtype.F32, Role.SCRATCH),
        Param("lse_part", ("B", "Hq", "NUM_SPLITS", "M"), Dtype.F32, Role.SCRATCH),
    )
    return Program(base.name, base.params + scratch, base.schedule, (part, combine), base.score_mod, base.mask_mod)


def _backward_params(dtype: Dtype, aux: tuple[Param, ...], scalars: tuple[str, ...]) -> tuple[Param, ...]:
    ins = tuple(Param(n, s, dtype, Role.IN) for n, s in (("q", ("B", "Hq", "M", "D")), ("k", ("B", "Hkv", "N", "D")),
                                                         ("v", ("B", "Hkv", "N", "D")), ("o", ("B", "Hq", "M", "D")),
                                                         ("dout", ("B", "Hq", "M", "D"))))
    return (
        *ins,
        Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.IN),
        Param("dq", ("B", "Hq", "M", "D"), dtype, Role.OUT),
        Param("dk", ("B", "Hkv", "N", "D"), dtype, Role.OUT),
        Param("dv", ("B", "Hkv", "N", "D"), dtype, Role.OUT),
        Param("delta", ("B", "Hq", "M"), Dtype.F32, Role.SCRATCH),
        Param("dq_acc", ("B", "Hq", "M", "D"), Dtype.F32, Role.SCRATCH),
        Param("sm_scale", (), Dtype.F32, Role.SCALAR),
        *(Param(s, (), Dtype.F32, Role.SCALAR) for s in scalars),
        *aux,
    )


def _backward_m_body(*, score_mod: bool, mask_mod: bool, block_classes: bool, aux_grads: tuple[tuple[str, str], ...],
                     dq_atomic: bool = True) -> tuple:
    """One (q block, KV block) step of the KV-outer backward: recompute P, accumulate dV, dK, and dQ by atomics
    (without `dq_atomic`, dQ is left to a separate pass)."""
    at = TileAt(E("b"), E("h"), E("m_start"), E("n_start"))
    rows = (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"))
    mask = Mask("sm", at, use_mask_mod=mask_mod)
    body: list = [
        Load("qt", "q", (*rows, Full())),
        Load("gt", "dout", (*rows, Full())),
        Load("lt", "lse", rows, other=float("inf")),
        Load("dt", "delta", rows),
        Dot("s", "qt", "kt", trans_b=True),
        Elementwise("s", E("s * sm_scale")),
        Elementwise("sm", E("s")),
        *((ScoreMod("sm", at),) if score_mod else ()),
        IfBlock(BlockClass.FULL, True, at, then=(mask,)) if block_classes else mask,
        Probs("p", "sm", "lt"),
        Dot("dvp", "p", "gt", trans_b=False, trans_a=True),
        Elementwise("dv_acc", E("dv_acc + dvp")),
        Dot("dp", "gt", "vt", trans_b=True),
        SoftmaxGrad("ds", "p", "dp", "dt"),
        *(AuxGrad(grad, aux_name, "ds", "s", at) for grad, aux_name in aux_grads),
        ScoreModGrad("ds", "s", at),
        Elementwise("ds", E("ds * sm_scale")),
        Dot("dkp", "ds", "qt", trans_b=False, trans_a=True),
        Elementwise("dk_acc", E("dk_acc + dkp")),
    ]
    if dq_atomic:
        body += [Dot("dqp", "ds", "kt", trans_b=False), Store("dq_acc", (*rows, Full()), "dqp", accumulate=True)]
    return tuple(body)


def _dq_pass(lo: str, hi: str, *, score_mod: bool, mask_mod: bool, block_classes: bool) -> tuple:
    """A q-block program's dQ: loop over KV blocks in [lo, hi), recompute P and dS, accumulate dQ in registers."""
    at = TileAt(E("b"), E("h"), E("m_start"), E("n_start"))
    rows = (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"))
    kv_tile = (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())
    mask = Mask("sm", at, use_mask_mod=mask_mod)
    loop = For("n_start", E(lo), E(hi), "BLOCK_N", "forward", (
        Load("kt", "k", kv_tile),
        Load("vt", "v", kv_tile),
        Dot("s", "qt", "kt", trans_b=True),
        Elementwise("s", E("s * sm_scale")),
        Elementwise("sm", E("s")),
        *((ScoreMod("sm", at),) if score_mod else ()),
        IfBlock(BlockClass.FULL, True, at, then=(mask,)) if block_classes else mask,
        Probs("p", "sm", "lt"),
        Dot("dp", "gt", "vt", trans_b=True),
        SoftmaxGrad("ds", "p", "dp", "dt"),
        ScoreModGrad("ds", "s", at),
        Elementwise("ds", E("ds * sm_scale")),
        Dot("dqp", "ds", "kt", trans_b=False),
        Elementwise("dq_t", E("dq_t + dqp")),
    ))
    return (
        Let("hk", E("h // (Hq // Hkv)")),
        Let("m_start", E("m * BLOCK_M")),
        Load("qt", "q", (*rows, Full())),
        Load("gt", "dout", (*rows, Full())),
        Load("lt", "lse", rows, other=float("inf")),
        Load("dt", "delta", rows),
        Init("dq_t", ("BLOCK_M", "HEAD_PAD"), 0.0, Dtype.F32),
        loop,
        Store("dq", (*rows, Full()), "dq_t"),
    )


def backward(
    name: str,
    *,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    m_lo: str = "0",
    m_hi: str = "M",
    dtype: Dtype = Dtype.F32,
    aux: tuple[Param, ...] = (),
    scalars: tuple[str, ...] = (),
    aux_grads: tuple[tuple[str, str], ...] = (),
    block_classes: bool = False,
    skip_empty: bool = False,
    dq_pass: tuple[str, str] | None = None,
    schedule: Schedule = Schedule(block_m=16, block_n=16, num_warps=4, num_stages=1),
) -> Program:
    """The canonical backward (notes/bwd_ir.md): delta = rowsum(dO * O); a KV-outer kernel with dk, dv in registers
    looping over the group's q heads and the q blocks in [m_lo, m_hi), dq by fp32 atomics; a convert kernel for dq.
    Each (grad, aux) of `aux_grads` adds `aux_grad grad of aux += ds` (grad: an f32 out param of aux's shape); `block_classes` masks only blocks that are not full;
    `skip_empty` wraps the q-block step in `if block(...) is not empty`. `dq_pass` = (lo, hi): dq by a separate pass
    instead (kernel bwd_dq over q blocks loops over KV blocks in [lo, hi), recomputing P and dS; no atomics)."""
    rows = (E("b"), E("h"), Span(E("m_start"), "BLOCK_M"))
    at = TileAt(E("b"), E("h"), E("m_start"), E("n_start"))
    preprocess = Kernel("bwd_preprocess", (GridAxis("b", E("B")), GridAxis("h", E("Hq")), GridAxis("m", E("cdiv(M, BLOCK_M)"))), (
        Let("m_start", E("m * BLOCK_M")),
        Load("ot", "o", (*rows, Full())),
        Load("gt", "dout", (*rows, Full())),
        Elementwise("og", E("ot * gt")),
        Reduce("dt", "sum", "og", 1),
        Store("delta", rows, "dt"),
    ))
    step = _backward_m_body(score_mod=score_mod is not None, mask_mod=mask_mod is not None,
                            block_classes=block_classes, aux_grads=aux_grads, dq_atomic=dq_pass is None)
    if skip_empty:
        step = (IfBlock(BlockClass.EMPTY, True, at, then=step),)
    kv_tile = (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())
    dkdv = Kernel("bwd_dkdv", (GridAxis("b", E("B")), GridAxis("hk", E("Hkv")), GridAxis("n", E("cdiv(N, BLOCK_N)"))), (
        Let("n_start", E("n * BLOCK_N")),
        Load("kt", "k", kv_tile),
        Load("vt", "v", kv_tile),
        Init("dk_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32),
        Init("dv_acc", ("BLOCK_N", "HEAD_PAD"), 0.0, Dtype.F32),
        For("h", E("hk * (Hq // Hkv)"), E("(hk + 1) * (Hq // Hkv)"), 1, "forward", (
            For("m_start", E(m_lo), E(m_hi), "BLOCK_M", "forward", step),
        )),
        Store("dk", kv_tile, "dk_acc"),
        Store("dv", kv_tile, "dv_acc"),
    ))
    convert = Kernel("bwd_dq", preprocess.grid, (
        Let("m_start", E("m * BLOCK_M")),
        Load("dqt", "dq_acc", (*rows, Full())),
        Store("dq", (*rows, Full()), "dqt"),
    ) if dq_pass is None else _dq_pass(*dq_pass, score_mod=score_mod is not None, mask_mod=mask_mod is not None,
                                       block_classes=block_classes))
    shapes = {a.name: a.shape for a in aux}
    grad_params = tuple(Param(grad, shapes[aux_name], Dtype.F32, Role.OUT) for grad, aux_name in aux_grads)
    return Program(
        name=name,
        params=tuple(x for x in _backward_params(dtype, aux, scalars) if dq_pass is None or x.name != "dq_acc") + grad_params,
        schedule=schedule,
        kernels=(preprocess, dkdv, convert),
        score_mod=VariantFn("score_mod", SCORE_MOD_PARAMS, E(score_mod)) if score_mod else None,
        mask_mod=VariantFn("mask_mod", MASK_MOD_PARAMS, E(mask_mod)) if mask_mod else None,
    )


def causal_bwd(dtype: Dtype = Dtype.F32) -> Program:
    """notes/bwd_ir.md's canonical program: causal, q blocks from the KV block's diagonal, masks on partial blocks."""
    return backward("causal_bwd", mask_mod="q_idx >= kv_idx", m_lo="n_start // BLOCK_M * BLOCK_M", dtype=dtype,
                    block_classes=True)


FIXTURES: dict[str, Callable[..., Program]] = {
    "plain": plain,
    "causal": causal,
    "sliding_window": sliding_window,
    "alibi": alibi,
    "softcap": softcap,
    "document": document,
    "gqa": gqa,
    "decode_split_kv": decode_split_kv,
}


def all_fixtures(dtype: Dtype = Dtype.F32) -> dict[str, Program]:
    return {name: build(dtype=dtype) for name, build in FIXTURES.items()}


# ---------------------------------------------------------------- serving layouts (varlen, paged KV)
# Token-major q/k/v/o [T, H, D] with per-sequence offsets, and KV caches behind a page table.
# Not in FIXTURES (whose programs every lowering runs): the CUDA lowering refuses these layouts; the Triton lowering
# runs them in tests/test_lower_serving.py.

VARLEN_PREFILL = """\
program varlen_prefill
param q: [T, Hq, D] f32 in
param k: [T, Hkv, D] f32 in
param v: [T, Hkv, D] f32 in
param o: [T, Hq, D] f32 out
param lse: [T, Hq] f32 out
param b_start_loc: [B] i32 aux
param b_seq_len: [B] i32 aux
param sm_scale: [] f32 scalar
param max_seq_len: [] i32 scalar
schedule block_m=16 block_n=8 num_warps=4 num_stages=1 head_pad=0 kv_order=forward num_splits=1 warp_specialize=False
mask_mod(b, h, q_idx, kv_idx) = (q_idx >= kv_idx) & (kv_idx < b_seq_len[b])
kernel fwd grid(b: B, h: Hq, m: cdiv(max_seq_len, BLOCK_M)):
  let hk = h // (Hq // Hkv)
  let q0 = b_start_loc[b]
  let q_len = b_seq_len[b]
  let m_start = m * BLOCK_M
  load qt = q[q0 + m_start:+BLOCK_M until q0 + q_len, h, :]
  init m_i = full(BLOCK_M; -inf) f32
  init l_i = full(BLOCK_M; 0.0) f32
  init acc = full(BLOCK_M, HEAD_PAD; 0.0) f32
  for n_start in range(0, minimum(q_len, m_start + BLOCK_M), BLOCK_N) forward:
    load kt = k[q0 + n_start:+BLOCK_N until q0 + q_len, hk, :]
    load vt = v[q0 + n_start:+BLOCK_N until q0 + q_len, hk, :]
    dot s = qt @ trans(kt)
    elementwise s = s * sm_scale
    mask s at (b, h, m_start, n_start) mask_mod
    online_softmax (m_i, l_i, acc) += s @ vt
  finalize ot, lt = (m_i, l_i, acc)
  store o[q0 + m_start:+BLOCK_M until q0 + q_len, h, :] = ot
  store lse[q0 + m_start:+BLOCK_M until q0 + q_len, h] = lt
"""

# vLLM-style paged decode: k/v caches [NUM_PAGES, PAGE, Hkv, D], block_table [B, MAX_PAGES];
# BLOCK_N == PAGE, so a KV tile is one page (a scalar page lookup, then a span inside it).
PAGED_DECODE = """\
program paged_decode
param q: [B, Hq, D] f32 in
param k: [NUM_PAGES, PAGE, Hkv, D] f32 in
param v: [NUM_PAGES, PAGE, Hkv, D] f32 in
param o: [B, Hq, D] f32 out
param lse: [B, Hq] f32 out
param block_table: [B, MAX_PAGES] i32 aux
param seq_lens: [B] i32 aux
param sm_scale: [] f32 scalar
schedule block_m=16 block_n=8 num_warps=4 num_stages=1 head_pad=0 kv_order=forward num_splits=1 warp_specialize=False
mask_mod(b, h, q_idx, kv_idx) = kv_idx < seq_lens[b]
kernel decode grid(b: B, h: Hq):
  let hk = h // (Hq // Hkv)
  let kv_len = seq_lens[b]
  load qt = q[b, h:+1, :]
  init m_i = full(1; -inf) f32
  init l_i = full(1; 0.0) f32
  init acc = full(1, HEAD_PAD; 0.0) f32
  for n_start in range(0, kv_len, BLOCK_N) forward:
    let page = block_table[b, n_start // BLOCK_N]
    load kt = k[page, 0:+BLOCK_N, hk, :]
    load vt = v[page, 0:+BLOCK_N, hk, :]
    dot s = qt @ trans(kt)
    elementwise s = s * sm_scale
    mask s at (b, h, kv_len - 1, n_start) mask_mod
    online_softmax (m_i, l_i, acc) += s @ vt
  finalize ot, lt = (m_i, l_i, acc)
  store o[b, h:+1, :] = ot
  store lse[b, h:+1] = lt
"""

# SGLang-style token-pool decode: k/v buffers [POOL, Hkv, D], req_to_token [B, MAX_CTX] gives
# each token's pool row; one gathered lookup per KV lane.
POOL_DECODE = """\
program pool_decode
param q: [B, Hq, D] f32 in
param k: [POOL, Hkv, D] f32 in
param v: [POOL, Hkv, D] f32 in
param o: [B, Hq, D] f32 out
param lse: [B, Hq] f32 out
param req_to_token: [B, MAX_CTX] i32 aux
param seq_lens: [B] i32 aux
param sm_scale: [] f32 scalar
schedule block_m=16 block_n=8 num_warps=4 num_stages=1 head_pad=0 kv_order=forward num_splits=1 warp_specialize=False
mask_mod(b, h, q_idx, kv_idx) = kv_idx < seq_lens[b]
kernel decode grid(b: B, h: Hq):
  let hk = h // (Hq // Hkv)
  let kv_len = seq_lens[b]
  load qt = q[b, h:+1, :]
  init m_i = full(1; -inf) f32
  init l_i = full(1; 0.0) f32
  init acc = full(1, HEAD_PAD; 0.0) f32
  for n_start in range(0, kv_len, BLOCK_N) forward:
    load kt = k[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if n_start + j < kv_len], hk, :]
    load vt = v[[req_to_token[b, n_start + j] for j in range(BLOCK_N) if n_start + j < kv_len], hk, :]
    dot s = qt @ trans(kt)
    elementwise s = s * sm_scale
    mask s at (b, h, kv_len - 1, n_start) mask_mod
    online_softmax (m_i, l_i, acc) += s @ vt
  finalize ot, lt = (m_i, l_i, acc)
  store o[b, h:+1, :] = ot
  store lse[b, h:+1] = lt
"""

# gpt-oss-style attention sinks on the paged decode: a learned logit per head joins the softmax's denominator and
# carries no value, i.e. the online softmax starts at m = sinks[h], l = 1 (acc = 0); an empty sequence gives o = 0.
PAGED_DECODE_SINKS = PAGED_DECODE.replace("program paged_decode", "program paged_decode_sinks").replace(
    "param seq_lens: [B] i32 aux\n", "param seq_lens: [B] i32 aux\nparam sinks: [Hq] f32 aux\n").replace(
    "init m_i = full(1; -inf) f32\n  init l_i = full(1; 0.0) f32",
    "init m_i = full(1; sinks[h]) f32\n  init l_i = full(1; 1.0) f32")

# flash_attn_varlen-style packed prefill as the serving transfer writes it: positions are global token indices (dims M,
# N), query i of a sequence sees its keys up to the bottom-right diagonal; the mask's two forms (that diagonal and the
# sequence's end) give the KV loop closed-form full blocks
PACKED_PREFILL = """\
program packed_prefill
param q: [M, Hq, D] f32 in
param k: [N, Hkv, D] f32 in
param v: [N, Hkv, D] f32 in
param o: [M, Hq, D] f32 out
param lse: [M, Hq] f32 out
param max_seq_len: [] i32 scalar
param sm_scale: [] f32 scalar
param cu_seqlens_q: [cu_seqlens_q_n0] i32 aux
param cu_seqlens_k: [cu_seqlens_k_n0] i32 aux
schedule block_m=16 block_n=16 num_warps=4 num_stages=1 head_pad=0 kv_order=forward num_splits=1 warp_specialize=False
mask_mod(b, h, q_idx, kv_idx) = (kv_idx - cu_seqlens_k[b] <= q_idx - cu_seqlens_q[b] + (cu_seqlens_k[b + 1] - cu_seqlens_k[b]) - (cu_seqlens_q[b + 1] - cu_seqlens_q[b])) & (kv_idx < cu_seqlens_k[b + 1])
kernel fwd grid(b: cu_seqlens_q_n0 - 1, h: Hq, m: cdiv(max_seq_len, BLOCK_M)):
  let k0 = cu_seqlens_k[b]
  let k_len = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
  let m_start = m * BLOCK_M
  let q0 = cu_seqlens_q[b]
  let q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
  let hk = h // (Hq // Hkv)
  load qt = q[q0 + m_start:+BLOCK_M until q0 + q_len, h, :]
  init m_i = full(BLOCK_M; -inf) f32
  init l_i = full(BLOCK_M; 0.0) f32
  init acc = full(BLOCK_M, HEAD_PAD; 0.0) f32
  for n_start in range(0, where(m_start < q_len, minimum(k_len, m_start + BLOCK_M + maximum(0, k_len - q_len)), 0), BLOCK_N) forward:
    load kt = k[k0 + n_start:+BLOCK_N until k0 + k_len, hk, :]
    load vt = v[k0 + n_start:+BLOCK_N until k0 + k_len, hk, :]
    dot qk = qt @ trans(kt)
    elementwise qk = qk * sm_scale
    mask qk at (b, h, q0 + m_start, k0 + n_start) mask_mod
    online_softmax (m_i, l_i, acc) += qk @ vt
  finalize ot, lt = (m_i, l_i, acc)
  store o[q0 + m_start:+BLOCK_M until q0 + q_len, h, :] = ot
  store lse[q0 + m_start:+BLOCK_M until q0 + q_len, h] = lt
"""

SERVING_TEXTS = {"varlen_prefill": VARLEN_PREFILL, "paged_decode": PAGED_DECODE, "pool_decode": POOL_DECODE,
                 "paged_decode_sinks": PAGED_DECODE_SINKS, "packed_prefill": PACKED_PREFILL}


__all__ = ["FIXTURES", "SERVING_TEXTS", "all_fixtures", "forward", "backward", "causal_bwd", "Expr"]


# ---- backward programs as IR text (the FA2 structure: KV-outer, dq accumulated in fp32 scratch)

_BWD_HEADER = """program {name}
param q: [B, Hq, M, D] f32 in
param k: [B, Hkv, N, D] f32 in
param v: [B, Hkv, N, D] f32 in
param o: [B, Hq, M, D] f32 in
param dout: [B, Hq, M, D] f32 in
param lse: [B, Hq, M] f32 in
param dq: [B, Hq, M, D] f32 out
param dk: [B, Hkv, N, D] f32 out
param dv: [B, Hkv, N, D] f32 out
param delta: [B, Hq, M] f32 scratch
param dq_acc: [B, Hq, M, D] f32 scratch
param sm_scale: [] f32 scalar
{extra}schedule block_m=16 block_n=16 num_warps=4 num_stages=1 head_pad=0 kv_order=forward num_splits=1 warp_specialize=False
{variants}"""

_BWD_KERNELS = """kernel bwd_preprocess grid(b: B, h: Hq, m: cdiv(M, BLOCK_M)):
  let m_start = m * BLOCK_M
  load ot = o[b, h, m_start:+BLOCK_M, :]
  load gt = dout[b, h, m_start:+BLOCK_M, :]
  elementwise og = ot * gt
  reduce dt = sum(og, 1)
  store delta[b, h, m_start:+BLOCK_M] = dt
kernel bwd_dkdv grid(b: B, hk: Hkv, n: cdiv(N, BLOCK_N)):
  let n_start = n * BLOCK_N
  load kt = k[b, hk, n_start:+BLOCK_N, :]
  load vt = v[b, hk, n_start:+BLOCK_N, :]
  init dk_acc = full(BLOCK_N, HEAD_PAD; 0.0) f32
  init dv_acc = full(BLOCK_N, HEAD_PAD; 0.0) f32
  for h in range(hk * (Hq // Hkv), (hk + 1) * (Hq // Hkv), 1) forward:
    for m_start in range({m_lo}, M, BLOCK_M) forward:
      if block(b, h, m_start, n_start) is not empty:
        load qt = q[b, h, m_start:+BLOCK_M, :]
        load gt = dout[b, h, m_start:+BLOCK_M, :]
        load lt = lse[b, h, m_start:+BLOCK_M] other inf
        load dt = delta[b, h, m_start:+BLOCK_M]
        dot s = qt @ trans(kt)
        elementwise s = s * sm_scale
        elementwise sm = s
{score_mod}        mask sm at (b, h, m_start, n_start) {mask}
        probs p = exp(sm - lt)
        dot dvp = trans(p) @ gt
        elementwise dv_acc = dv_acc + dvp
        dot dp = gt @ trans(vt)
        softmax_grad ds = p * (dp - dt)
{aux_grad}        score_mod_grad ds wrt s at (b, h, m_start, n_start)
        elementwise ds = ds * sm_scale
        dot dkp = trans(ds) @ qt
        elementwise dk_acc = dk_acc + dkp
        dot dqp = ds @ kt
        store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp
  store dk[b, hk, n_start:+BLOCK_N, :] = dk_acc
  store dv[b, hk, n_start:+BLOCK_N, :] = dv_acc
kernel bwd_dq grid(b: B, h: Hq, m: cdiv(M, BLOCK_M)):
  let m_start = m * BLOCK_M
  load dqt = dq_acc[b, h, m_start:+BLOCK_M, :]
  store dq[b, h, m_start:+BLOCK_M, :] = dqt
"""


def backward_text(name: str, *, score_mod: str | None = None, mask_mod: str | None = None,
                  extra: str = "", aux_grad: str | None = None, m_lo: str = "0") -> str:
    variants = (f"score_mod(score, b, h, q_idx, kv_idx) = {score_mod}\n" if score_mod else "") + \
        (f"mask_mod(b, h, q_idx, kv_idx) = {mask_mod}\n" if mask_mod else "")
    at = "(b, h, m_start, n_start)"
    return _BWD_HEADER.format(name=name, extra=extra, variants=variants) + _BWD_KERNELS.format(
        m_lo=m_lo, mask="mask_mod" if mask_mod else "bounds",
        score_mod=f"        score_mod sm at {at}\n" if score_mod else "",
        aux_grad=f"        aux_grad {aux_grad} += ds wrt s at {at}\n" if aux_grad else "")
