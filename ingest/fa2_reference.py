"""The FA2 CUDA forward kernel as one reference IR Program, assembled from the CUDA lifter's output.

The CUDA lifter (`ingest.lift_cuda`) turns FlashAttention-2's C++ into snippets with IR
meanings and launch tunables; it does not produce a Program. `build_fa2_reference` assembles
one from those pieces, following `compute_attn_1rowblock` in flash_fwd_kernel.h:

- one CTA per (batch, head, query block); the q tile stays resident;
- KV blocks are visited from `n_block_max - 1` down to 0 (`kv_order=reverse`), so the blocks
  that need masking (ragged last block, diagonal blocks) come first and the mask-free ones
  after: the IR says this as one reverse loop whose mask is applied under
  `if block(...) is not full` (FA2 counts the masked steps statically, `n_masking_steps`;
  `masking_steps_cover` checks that count covers every block the IR masks);
- n_block_max, the causal mask (bottom-right aligned), the GQA head mapping, the online
  softmax and the finalize/epilogue names are taken from the lifted snippets' `ir_text`
  (parsed, never retyped here);
- the schedule is the sm80 head-dim-128 launch tunable (kBlockM, kBlockN, kNWarps), with
  head_pad = 128 (the kernel's kHeadDim) and num_stages = 1 (one K and one V smem buffer).

Invariants: every snippet the Program depends on is named in `LiftedProgram.notes` with its
file and line span; a missing one raises `KBError` naming it; the Program validates, and
`verified` is True only when the interpreter matched dense torch on ragged shapes (including
seq_q > seq_kv, where bottom-right causal rows see no key) at the lifted schedule and at 16x16.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace

import torch

from ingest.lift_verify import dense_reference, verify_program
from ingest.model import LiftedProgram, LiftedSnippet, LiftedTunable, LiftReport, Provenance, as_int
from kb.errors import KBError
from kb.features import Features
from kb.ir.evaluate import eval_expr
from kb.ir.expr import Expr, ExprOp, const, free_vars, parse_expr, substitute, var
from kb.ir.features import derive_features
from kb.ir.interp_variants import classify_block
from kb.ir.interpret import run_program
from kb.ir.nodes import (
    MASK_MOD_PARAMS, BlockClass, Dot, Dtype, Elementwise, Finalize, For, Full, GridAxis, IfBlock, Init, Kernel,
    Let, Load, Mask, OnlineSoftmax, Param, Program, Role, Schedule, Span, Store, TileAt, VariantFn,
)
from kb.ir.validate import validate

__all__ = ["build_fa2_reference", "build_fa2_references", "masking_steps_cover", "LIFTER", "LIFTER_VERSION"]

log = logging.getLogger(__name__)
LIFTER = "fa2_reference"
LIFTER_VERSION = "1"
FAMILY = "fa2_cuda"
HEAD_DIM = 128
ARCH = "sm80"
_MAIN_SCOPE = "compute_attn_1rowblock"
_KERNEL_FILE = "flash_fwd_kernel.h"
_MASK_FILE = "mask.h"
# FA2 instantiates fp16 and bf16 with the same tiles; the reference uses fp16 I/O (o is stored in
# the I/O dtype, and fp16's 11-bit mantissa keeps the interpreter-vs-fp32 check tight).
_DTYPE, _TUNABLE_DTYPE = Dtype.F16, "fp16"
_SCOPE = re.compile(r"\[(.*?)::(?:function|struct|if|else|stmt) ")
_ONLINE = re.compile(r"^online_softmax \((\w+), (\w+), (\w+)\) \+= (\w+) @ (\w+)$")
_FINALIZE = re.compile(r"^finalize (\w+), (\w+) = \((\w+), (\w+), (\w+)\)$")


@dataclass(frozen=True)
class _Parts:
    """The lifted pieces the Program is assembled from."""

    n_block_max: LiftedSnippet
    mask_causal: LiftedSnippet
    mask_bounds: LiftedSnippet
    online: LiftedSnippet
    finalize: LiftedSnippet
    gqa: LiftedSnippet | None
    masking_steps: LiftedSnippet | None
    epilogue: tuple[LiftedSnippet, ...]  # lse stores in line order: early exit (empty KV range), then the epilogue
    span: Provenance  # flash_fwd_kernel.h lines of the lifted compute_attn_1rowblock regions


# ---------------------------------------------------------------- picking snippets


def _scope(s: LiftedSnippet) -> str:
    """The enclosing C++ scope, as lift_cuda writes it in the title: `[scope::kind head]`."""
    m = _SCOPE.search(s.title)
    return m.group(1) if m else ""


def _in(s: LiftedSnippet, file: str) -> bool:
    return s.provenance.file.endswith("/" + file) or s.provenance.file == file


def _expr(s: LiftedSnippet) -> Expr:
    try:
        return parse_expr(s.ir_text)
    except KBError as err:
        raise KBError(f"lifted {s.kind} snippet {s.provenance.file}:{s.provenance.line_start} has IR "
                      f"{s.ir_text!r} that does not parse: {err}") from None


def _need(found: list[LiftedSnippet], what: str) -> LiftedSnippet:
    if not found:
        raise KBError(f"FA2 reference program: no lifted {what} snippet; re-run the CUDA lifter on "
                      f"csrc/flash_attn/src ({_KERNEL_FILE}, {_MASK_FILE}) of flash-attn 2.x")
    return found[0]


def _pick(snippets: list[LiftedSnippet]) -> _Parts:
    main = [s for s in snippets if _in(s, _KERNEL_FILE) and _scope(s) == _MAIN_SCOPE]
    if not main:
        raise KBError(f"FA2 reference program: no lifted region of {_MAIN_SCOPE} in {_KERNEL_FILE}; "
                      "pass the CUDA reports of csrc/flash_attn/src")
    kind = lambda k, pool=main: [s for s in pool if s.kind == k]  # noqa: E731
    nmax = _need([s for s in kind("kv_loop_bounds") if _expr(s).op is ExprOp.MINIMUM
                  and "window_right" in free_vars(_expr(s))], f"kv_loop_bounds (n_block_max) of {_MAIN_SCOPE}")
    steps = [s for s in kind("kv_loop_bounds") if "even_mn" in free_vars(_expr(s))]
    online = _need([s for s in kind("online_softmax") if _ONLINE.match(s.ir_text)], f"online_softmax of {_MAIN_SCOPE}")
    fin = _need([s for s in kind("softmax_finalize") if _FINALIZE.match(s.ir_text)], f"softmax_finalize of {_MAIN_SCOPE}")
    gqa = kind("gqa") or [s for s in snippets if s.kind == "gqa" and "Hkv" in s.ir_text]
    epi = sorted((s for s in kind("epilogue") if s.ir_text.startswith("store lse")), key=lambda s: s.provenance.line_start)
    masks = [s for s in snippets if _in(s, _MASK_FILE)]
    causal = [s for s in masks if s.kind == "mask_causal" and {"q_idx", "kv_idx", "M", "N"} <= free_vars(_expr(s))]
    if len({_expr(s) for s in causal}) > 1:
        raise KBError(f"FA2 reference program: the bottom-right causal mask snippets of {_MASK_FILE} disagree: "
                      + "; ".join(f"line {s.provenance.line_start}: {s.ir_text}" for s in causal))
    by_mask_struct = lambda pool: sorted(pool, key=lambda s: not _scope(s).startswith("Mask::apply_mask"))  # noqa: E731
    mask = _need(by_mask_struct(causal), f"mask_causal (bottom-right, {_MASK_FILE})")
    bounds = _need(by_mask_struct([s for s in masks if s.kind == "mask_bounds"]), f"mask_bounds ({_MASK_FILE})")
    if _expr(bounds) != parse_expr("kv_idx < N"):
        raise KBError(f"FA2 reference program: the lifted key-bounds mask is {bounds.ir_text!r}, not the IR's kv_idx < N")
    p0 = main[0].provenance
    span = replace(p0, line_start=min(s.provenance.line_start for s in main),
                   line_end=max(s.provenance.line_end for s in main), lifter=LIFTER, lifter_version=LIFTER_VERSION)
    return _Parts(nmax, mask, bounds, online, fin, gqa[0] if gqa else None, steps[0] if steps else None,
                  tuple(epi), span)


def _pick_tunable(tunables: list[LiftedTunable], causal: bool) -> LiftedTunable:
    """The sm80 hdim-128 forward launch (no dropout), matching the causal flag where the source branches on it."""
    def fits(t: LiftedTunable) -> bool:
        terms = {c.strip() for c in t.condition.split("&&") if c.strip()}
        return (t.family == FAMILY and t.arch == ARCH and t.head_dim == HEAD_DIM and t.dtype == _TUNABLE_DTYPE
                and "Is_dropout" not in terms and ("!Is_causal" if causal else "Is_causal") not in terms)
    return _need_tunable([t for t in tunables if fits(t)])


def _need_tunable(found: list[LiftedTunable]) -> LiftedTunable:
    if not found:
        raise KBError(f"FA2 reference program: no lifted {FAMILY} {ARCH} head_dim={HEAD_DIM} launch tunable "
                      "(run_mha_fwd_hdim128 in flash_fwd_launch_template.h); pass that file's LiftReport tunables")
    return found[0]


# ---------------------------------------------------------------- assembly


def _head_map(parts: _Parts) -> Expr:
    return _expr(parts.gqa) if parts.gqa is not None else var("h")


def _n_block_max(parts: _Parts, causal: bool) -> Expr:
    """FA2: ceil_div(seqlen_k, kBlockN), clipped to the diagonal when causal (window_right = 0)."""
    e = _expr(parts.n_block_max)
    return _drop_zero_terms(substitute(e, {"window_right": const(0)})) if causal else e.args[0]


def _drop_zero_terms(e: Expr) -> Expr:
    """`x + 0` / `x - 0` -> `x` (what substituting a zero window leaves behind)."""
    args = tuple(_drop_zero_terms(a) for a in e.args)
    if e.op in (ExprOp.ADD, ExprOp.SUB) and args[1] == const(0):
        return args[0]
    return replace(e, args=args)


def _kv_loop(parts: _Parts, causal: bool) -> For:
    m, l, acc, s, vt = _ONLINE.match(parts.online.ir_text).groups()  # type: ignore[union-attr]
    at = TileAt(var("b"), var("h"), var("m_start"), var("n_start"))
    body = (
        Load("kt", "k", (var("b"), var("hk"), Span(var("n_start"), "BLOCK_N"), Full())),
        Load(vt, "v", (var("b"), var("hk"), Span(var("n_start"), "BLOCK_N"), Full())),
        Dot(s, "qt", "kt", trans_b=True),
        Elementwise(s, var(s) * var("sm_scale")),
        IfBlock(BlockClass.FULL, True, at, then=(Mask(s, at, use_mask_mod=causal),)),
        OnlineSoftmax(m, l, acc, s, vt),
    )
    return For("n_start", const(0), var("n_block_max") * var("BLOCK_N"), "BLOCK_N", "reverse", body)



def _program(parts: _Parts, tunable: LiftedTunable, causal: bool) -> Program:
    m, l, acc, _, _ = _ONLINE.match(parts.online.ir_text).groups()  # type: ignore[union-attr]
    ot, lt, fm, fl, facc = _FINALIZE.match(parts.finalize.ir_text).groups()  # type: ignore[union-attr]
    if (fm, fl, facc) != (m, l, acc):
        raise KBError(f"FA2 reference program: finalize reads ({fm}, {fl}, {facc}) but the online softmax "
                      f"keeps ({m}, {l}, {acc})")
    gqa = parts.gqa is not None
    hkv = "Hkv" if gqa else "Hq"
    params = (
        Param("q", ("B", "Hq", "M", "D"), _DTYPE, Role.IN),
        Param("k", ("B", hkv, "N", "D"), _DTYPE, Role.IN),
        Param("v", ("B", hkv, "N", "D"), _DTYPE, Role.IN),
        Param("o", ("B", "Hq", "M", "D"), _DTYPE, Role.OUT),
        Param("lse", ("B", "Hq", "M"), Dtype.F32, Role.OUT),
        Param("sm_scale", (), Dtype.F32, Role.SCALAR),
    )
    q_tile = Span(var("m_start"), "BLOCK_M")
    body = (
        Let("hk", _head_map(parts)),
        Let("m_start", parse_expr("m * BLOCK_M")),
        Let("n_block_max", _n_block_max(parts, causal)),
        Load("qt", "q", (var("b"), var("h"), q_tile, Full())),
        Init(m, ("BLOCK_M",), float("-inf"), Dtype.F32),
        Init(l, ("BLOCK_M",), 0.0, Dtype.F32),
        Init(acc, ("BLOCK_M", "HEAD_PAD"), 0.0, Dtype.F32),
        _kv_loop(parts, causal),
        Finalize(ot, lt, m, l, acc),
        Store("o", (var("b"), var("h"), q_tile, Full()), ot),
        Store("lse", (var("b"), var("h"), q_tile), lt),
    )
    grid = (GridAxis("b", var("B")), GridAxis("h", var("Hq")), GridAxis("m", parse_expr("cdiv(M, BLOCK_M)")))
    p = tunable.params
    sched = Schedule(block_m=as_int(p["block_m"]), block_n=as_int(p["block_n"]), num_warps=as_int(p["num_warps"]),
                     num_stages=as_int(p.get("num_stages", 1)), head_pad=tunable.head_dim, kv_order="reverse")
    mask_mod = VariantFn("mask_mod", MASK_MOD_PARAMS, _expr(parts.mask_causal)) if causal else None
    name = f"{FAMILY}_fwd_hdim{tunable.head_dim}_{tunable.arch}" + ("_causal" if causal else "")
    return Program(name, params, sched, (Kernel("flash_fwd_kernel", grid, body),), mask_mod=mask_mod)


# ---------------------------------------------------------------- checks


def masking_steps_cover(steps_expr: Expr, program: Program, shapes: list[tuple[int, int]], *, causal: bool,
                        even_mn: bool = False) -> bool:
    """True when FA2's static `n_masking_steps` covers every KV block the IR masks (on `shapes` (M, N)).

    `steps_expr` is the lifted n_masking_steps expression (names causal, local, even_mn, BLOCK_M,
    BLOCK_N); even_mn=False is FA2's value for ragged lengths, the case the IR must cover.

    For each query block, the blocks classed not-full must be among the first n_masking_steps
    visited by the reverse loop (block indices >= n_block_max - n_masking_steps).
    """
    s = program.schedule
    env0 = {"BLOCK_M": s.block_m, "BLOCK_N": s.block_n, "causal": causal, "local": False, "even_mn": even_mn}
    steps = int(eval_expr(steps_expr, env0))
    nmax_e = next(st.value for st in program.kernels[0].body if isinstance(st, Let) and st.name == "n_block_max")
    for M, N in shapes:
        for m in range(math.ceil(M / s.block_m)):
            nmax = int(eval_expr(nmax_e, {**env0, "M": M, "N": N, "m": m}))
            for n in range(max(nmax, 0)):
                cls = classify_block(program.mask_mod, {"M": M, "N": N}, {}, 0, 0, m * s.block_m, n * s.block_n,
                                     s.block_m, s.block_n, M, N)
                if cls is not BlockClass.FULL and n < nmax - steps:
                    return False
    return True


def _check_fully_masked_rows(p: Program) -> tuple[bool, str]:
    """seq_q > seq_kv with a bottom-right causal mask: leading query rows see no key (o = 0, lse = -inf)."""
    g = torch.Generator().manual_seed(1)
    M, N, D, H = 45, 29, 24, 2
    prog = replace(p, schedule=replace(p.schedule, block_m=16, block_n=16))
    q = torch.randn(1, H, M, D, generator=g).to(torch.float16)
    k = torch.randn(1, H, N, D, generator=g).to(torch.float16)
    v = torch.randn(1, H, N, D, generator=g).to(torch.float16)
    scale = 1.0 / math.sqrt(D)
    out = run_program(prog, {"q": q, "k": k, "v": v, "sm_scale": scale})
    ro, rl = dense_reference(p, q, k, v, scale, {})
    fin = torch.isfinite(rl)
    if not torch.equal(fin, torch.isfinite(out["lse"])):
        return False, f"fully-masked rows differ at M={M} N={N}"
    err = max((out["o"].float() - ro).abs().max().item(), (out["lse"][fin] - rl[fin]).abs().max().item())
    if err > 4e-3:
        return False, f"mismatch at M={M} N={N} (16x16): max abs err {err:.1e}"
    return True, f"M={M} > N={N}: {int((~fin).sum())} fully masked rows give o = 0, lse = -inf"


def _verify(p: Program, parts: _Parts, causal: bool) -> tuple[bool, str]:
    ok, note = verify_program(p, split=False, gqa=parts.gqa is not None)
    if not ok:
        return ok, note
    ok2, note2 = _check_fully_masked_rows(p)
    if not ok2:
        return ok2, note2
    return True, f"{note}; {note2}"


# ---------------------------------------------------------------- public API


def _notes(parts: _Parts, tunable: LiftedTunable, causal: bool, cover: bool | None) -> tuple[str, ...]:
    def at(s: LiftedSnippet) -> str:
        return f"{s.provenance.file.rsplit('/', 1)[-1]}:{s.provenance.line_start}-{s.provenance.line_end}"

    notes = [
        f"n_block_max from {at(parts.n_block_max)}: {parts.n_block_max.ir_text}"
        + (" with window_right = 0 (causal = local window (inf, 0))" if causal else " (first operand: no causal clip)"),
        f"key bounds from {at(parts.mask_bounds)}: {parts.mask_bounds.ir_text} (the IR's mask always applies it)",
        f"online softmax from {at(parts.online)}; finalize from {at(parts.finalize)}",
        f"schedule from {tunable.condition or 'always'} at {tunable.provenance.file.rsplit('/', 1)[-1]}:"
        f"{tunable.provenance.line_start}: {tunable.params}; head_pad = kHeadDim {tunable.head_dim}; "
        "num_stages 1 (one K and one V smem buffer; the next K load overlaps P @ V)",
        "FA2 keeps scores unscaled and folds the scale into exp2(s * scale_log2 - m * scale_log2); the IR scales "
        "first and uses natural exp: the same softmax",
        "FA2 writes lse = +inf for rows with no key (for its backward); the IR's convention is lse = -inf, o = 0",
    ]
    if causal:
        notes.insert(0, f"mask_mod from {at(parts.mask_causal)}: {parts.mask_causal.ir_text}")
    notes.append(f"GQA head map from {at(parts.gqa)}: {parts.gqa.ir_text}" if parts.gqa
                 else "no GQA snippet lifted: k/v have Hq heads (hk = h)")
    if parts.masking_steps is not None:
        notes.append(f"n_masking_steps from {at(parts.masking_steps)}: {parts.masking_steps.ir_text}; the IR masks "
                     "per block (`if block(...) is not full`); static count covers the IR's masked blocks: "
                     f"{cover}")
    if len(parts.epilogue) > 1:
        notes.append(f"early exit at {at(parts.epilogue[0])} (n_block_max <= n_block_min: o = 0 stored, no KV "
                     "block read): the IR runs the empty reverse loop and finalize gives the same o")
    if parts.epilogue:
        notes.append(f"lse epilogue from {at(parts.epilogue[-1])}: {parts.epilogue[-1].ir_text}")
    return tuple(notes)


def _features(p: Program) -> Features:
    return derive_features(p, arch=ARCH)


def build_fa2_reference(cuda_reports: list[LiftReport], tunables: list[LiftedTunable], *,
                        causal: bool = True) -> LiftedProgram:
    """FA2's CUDA forward kernel (compute_attn_1rowblock) as a verified IR Program; KBError names a missing piece."""
    parts = _pick([s for r in cuda_reports for s in r.snippets])
    tunable = _pick_tunable(list(tunables), causal)
    prog = _program(parts, tunable, causal)
    validate(prog)
    cover = None
    if parts.masking_steps is not None:
        shapes = [(37, 37), (29, 45), (45, 30), (37, 50), (100, 77), (300, 200), (64, 256)]  # N - M off the block grid too
        small = replace(prog, schedule=replace(prog.schedule, block_m=16, block_n=16))
        cover = all(masking_steps_cover(_expr(parts.masking_steps), p, shapes, causal=causal) for p in (prog, small))
    ok, note = _verify(prog, parts, causal)
    if cover is False:
        ok, note = False, f"FA2's static n_masking_steps misses a block the IR masks; {note}"
    related = tuple(t for t in tunables if t.family == FAMILY and t.head_dim == tunable.head_dim)
    log.info("FA2 reference %s: verified=%s (%s)", prog.name, ok, note)
    return LiftedProgram(prog.name, FAMILY, prog, parts.span, related, ok, note, _features(prog),
                         (("Is_causal", causal),), _notes(parts, tunable, causal, cover))


def build_fa2_references(cuda_reports: list[LiftReport], tunables: list[LiftedTunable]) -> list[LiftedProgram]:
    """The causal and the non-causal reference."""
    return [build_fa2_reference(cuda_reports, tunables, causal=c) for c in (True, False)]
