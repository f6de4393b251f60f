"""Hand-written IR programs used as test fixtures (not KB content: KB content comes from ingest).

Each builder returns a complete Program; `FIXTURES` names them all. Shapes are symbolic:
q: [B, Hq, M, D], k/v: [B, Hkv, N, D], o: [B, Hq, M, D], lse: [B, Hq, M].
"""

from __future__ import annotations

from kb.ir.expr import Expr, parse_expr as E
from kb.ir.nodes import (
    BlockClass, Combine, Dot, Dtype, Elementwise, Finalize, For, Full, GridAxis, IfBlock, Init,
    Kernel, Let, Load, Mask, OnlineSoftmax, Param, Program, Role, Schedule, ScoreMod, Span, Store,
    VariantFn, MASK_MOD_PARAMS, SCORE_MOD_PARAMS,
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
    at = dict(b=E("b"), h=E("h"), q_start=E("m_start"), kv_start=E("n_start"))
    body: list = [
        Load("kt", "k", (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())),
        Load("vt", "v", (E("b"), E("hk"), Span(E("n_start"), "BLOCK_N"), Full())),
        Dot("s", "qt", "kt", trans_b=True),
        Elementwise("s", E("s * sm_scale")),
    ]
    if score_mod:
        body.append(ScoreMod("s", **at))
    if block_classes:
        # full blocks skip masking entirely; partial ones apply bounds + mask_mod
        body.append(IfBlock(BlockClass.FULL, True, then=(Mask("s", use_mask_mod=mask_mod, **at),), **at))
    else:
        body.append(Mask("s", use_mask_mod=mask_mod, **at))
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


FIXTURES = {
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


__all__ = ["FIXTURES", "all_fixtures", "forward", "Expr"]
