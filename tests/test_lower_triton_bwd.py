"""Triton lowering of backward programs: dq, dk, dv (and a learnable table's gradient) under the Triton interpreter
against torch autograd of a dense fp32 reference, for each variant class; the autograd glue end to end; the
golden source of the canonical causal program; an sm90 compile of the backward kernels (no GPU needed).

Shapes are ragged (M = N = 40 with 16 x 16 blocks), and one case has fully masked rows.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from generate.candidate import write_candidate
from kb.errors import KBError
from kb.ir.design import Design, parse_design
from kb.ir.expr import parse_expr as E
from kb.ir.interpret import run_program
from kb.ir.nodes import Dtype, For, GridAxis, Kernel, Let, Param, Program, Role, Store, aux_gradients, walk_stmts
from kb.ir.validate import problems
from kb.lower.runtime import TritonKernel, load_module
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch
from kb.lower.triton_bwd import check_pair, dq_swap_kernels, lower_autograd
from kb.lower.triton_host import kernel_fn_name
from tests.support.backward import CLASSES, SPECS, fa2_triton_lift, transferred_programs
from tests.support.ir_programs import backward, causal_bwd, forward
from tests.support.repo import TEST_CACHE
from tests.support.split_parts import part_code

GOLDEN = Path(__file__).parent / "golden" / "triton"
UPDATE_GOLDEN = os.environ.get("KB_UPDATE_GOLDEN") == "1"  # read at import: conftest clears KB_* per test
SLIDE = "n_start // BLOCK_M * BLOCK_M"  # causal-like: no q block above the KV block's diagonal


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton_bwd_cache")


@dataclass(frozen=True)
class Case:
    program: Callable[[], Program]
    score: Callable | None = None  # (s, b, h, q_idx, kv_idx, aux, scalars) -> s' (torch, differentiable)
    mask: Callable | None = None  # (b, h, q_idx, kv_idx, aux) -> bool tensor
    aux: dict[str, Callable[[int, int, int], torch.Tensor]] = field(default_factory=dict)  # name -> f(B, Hq, N)
    scalars: dict[str, float] = field(default_factory=dict)
    hq: int = 2
    hkv: int = 2


def _causal(b, h, q, k, aux):
    return q >= k


def _docs(B: int, Hq: int, N: int) -> torch.Tensor:
    ids = torch.tensor([0] * 11 + [1] * 17 + [2] * (N - 28))
    return torch.stack([ids, torch.roll(ids, 5).sort().values])[:B].to(torch.int32)


REL = "score + rel[h, q_idx - kv_idx + N - 1]"
CASES = {
    "plain": Case(lambda: backward("plain_bwd")),
    "causal": Case(causal_bwd, mask=_causal),
    "sliding_window": Case(
        lambda: backward("sliding_bwd", mask_mod="(q_idx >= kv_idx) & (q_idx - kv_idx < 20)", m_lo=SLIDE,
                         m_hi="minimum(M, n_start + BLOCK_N + 19)", block_classes=True),
        mask=lambda b, h, q, k, aux: (q >= k) & (q - k < 20)),
    "alibi": Case(
        lambda: backward("alibi_bwd", score_mod="score + slopes[h] * (kv_idx - q_idx)", mask_mod="q_idx >= kv_idx",
                         m_lo=SLIDE, aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),)),
        score=lambda s, b, h, q, k, aux, sc: s + aux["slopes"][h] * (k - q), mask=_causal,
        aux={"slopes": lambda B, Hq, N: torch.tensor([0.5, 0.25])}),
    "softcap": Case(
        lambda: backward("softcap_bwd", score_mod="softcap * tanh(score / softcap)", scalars=("softcap",)),
        score=lambda s, b, h, q, k, aux, sc: sc["softcap"] * torch.tanh(s / sc["softcap"]), scalars={"softcap": 1.5}),
    "document": Case(
        lambda: backward("document_bwd", mask_mod="(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)",
                         m_lo=SLIDE, aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),), block_classes=True,
                         skip_empty=True),
        mask=lambda b, h, q, k, aux: (aux["doc_ids"][b, q] == aux["doc_ids"][b, k]) & (q >= k),
        aux={"doc_ids": _docs}),
    "gqa": Case(lambda: backward("gqa_bwd", mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True),
                mask=_causal, hq=4, hkv=2),
    "rel_bias": Case(  # a learnable table: drel by atomic scatter (the index moves with q_idx - kv_idx)
        lambda: backward("rel_bwd", score_mod=REL, mask_mod="q_idx >= kv_idx", m_lo=SLIDE,
                         aux=(Param("rel", ("Hq", "R"), Dtype.F32, Role.AUX),), aux_grads=(("drel", "rel"),)),
        score=lambda s, b, h, q, k, aux, sc: s + aux["rel"][h, q - k + s.shape[-1] - 1], mask=_causal,
        aux={"rel": lambda B, Hq, N: 0.3 * torch.randn(Hq, 2 * N - 1)}),
    "learnable_terms": Case(  # gradients reduced over the tile before the atomic: per head, per query row, per key
        lambda: backward("terms_bwd", score_mod="score * temp[h] + qb[b, q_idx] + kb[kv_idx]",
                         aux=(Param("temp", ("Hq",), Dtype.F32, Role.AUX), Param("qb", ("B", "M"), Dtype.F32, Role.AUX),
                              Param("kb", ("N",), Dtype.F32, Role.AUX)),
                         aux_grads=(("dtemp", "temp"), ("dqb", "qb"), ("dkb", "kb"))),
        score=lambda s, b, h, q, k, aux, sc: s * aux["temp"][h] + aux["qb"][b, q] + aux["kb"][k],
        aux={"temp": lambda B, Hq, N: torch.tensor([0.7, 1.3]), "qb": lambda B, Hq, N: torch.randn(B, N),
             "kb": lambda B, Hq, N: torch.randn(N)}),
    "causal_dq_pass": Case(  # dq by a separate pass over KV blocks (no atomics; its KV loop split by block class)
        lambda: backward("causal_dq_pass_bwd", mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True,
                         dq_pass=("0", "minimum(N, m_start + BLOCK_M)")), mask=_causal),
    "softcap_gqa_dq_pass": Case(
        lambda: backward("softcap_dq_pass_bwd", score_mod="softcap * tanh(score / softcap)", scalars=("softcap",),
                         dq_pass=("0", "N")),
        score=lambda s, b, h, q, k, aux, sc: sc["softcap"] * torch.tanh(s / sc["softcap"]), scalars={"softcap": 1.5},
        hq=4, hkv=2),
    "gqa_group_dq_pass": Case(  # the dq pass as lifted GQA references write it: per KV head, walking its group
        lambda: _walking_the_group(CASES["softcap_gqa_dq_pass"].program()),
        score=lambda s, b, h, q, k, aux, sc: sc["softcap"] * torch.tanh(s / sc["softcap"]), scalars={"softcap": 1.5},
        hq=6, hkv=2),
    "empty_rows": Case(  # rows 0..2 attend to nothing: lse = -inf there, their gradients 0
        lambda: backward("empty_rows_bwd", mask_mod="kv_idx + 3 <= q_idx", block_classes=True, skip_empty=True),
        mask=lambda b, h, q, k, aux: k + 3 <= q),
}


def _walking_the_group(p: Program) -> Program:
    """`p` with its dq pass launched per KV head, looping over the group's query heads (`let hk = ...` dropped):
    the form `kb.lower.group_grid` spreads back over the grid."""
    def walk(k: Kernel) -> Kernel:
        if k.name != "bwd_dq":
            return k
        lets, rest = k.body[1:2], k.body[2:]  # k.body[0] is `let hk = h // (Hq // Hkv)`
        loop = For("h", E("hk * (Hq // Hkv)"), E("(hk + 1) * (Hq // Hkv)"), 1, "forward", rest)
        grid = tuple(GridAxis("hk", E("Hkv")) if ax.name == "h" else ax for ax in k.grid)
        return dataclasses.replace(k, grid=grid, body=(*lets, loop))
    return dataclasses.replace(p, name="gqa_group_dq_pass_bwd", kernels=tuple(walk(k) for k in p.kernels))


def _reference(case: Case, q, k, v, aux: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 attention with torch ops (differentiable in q, k, v and the float aux tensors)."""
    B, Hq, M, _ = q.shape
    N = k.shape[2]
    rep = Hq // k.shape[1]
    s = scale * q @ k.repeat_interleave(rep, 1).transpose(-1, -2)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(Hq).view(1, Hq, 1, 1)
    qi, ki = torch.arange(M).view(1, 1, M, 1), torch.arange(N).view(1, 1, 1, N)
    if case.score is not None:
        s = case.score(s, b, h, qi, ki, aux, case.scalars)
    if case.mask is not None:
        s = s.masked_fill(~case.mask(b, h, qi, ki, aux).expand(s.shape), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v.repeat_interleave(rep, 1), lse


def _tensors(case: Case, B: int, M: int, N: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, case.hq, M, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, case.hkv, N, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, case.hkv, N, D, generator=g).to(dtype).requires_grad_()
    torch.manual_seed(seed)
    aux = {n: make(B, case.hq, N) for n, make in case.aux.items()}
    aux = {n: t.requires_grad_() if t.is_floating_point() else t for n, t in aux.items()}
    return q, k, v, aux


def _check(name: str, cache_dir: Path, *, B: int = 2, M: int = 40, N: int = 40, D: int = 16,
           dtype: Dtype = Dtype.F32, tol: float = 2e-4, seed: int = 0, design: Design | None = None,
           longest_first: bool = False) -> dict[str, torch.Tensor]:
    case = CASES[name]
    torch_dtype = torch.float32 if dtype is Dtype.F32 else torch.bfloat16
    p = case.program() if dtype is Dtype.F32 else dataclasses.replace(
        case.program(), params=tuple(dataclasses.replace(x, dtype=dtype) if x.name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")
                                     else x for x in case.program().params))
    assert problems(p) == (), problems(p)
    q, k, v, aux = _tensors(case, B, M, N, D, torch_dtype, seed)
    scale = 1 / math.sqrt(D)
    o, lse = _reference(case, q.float(), k.float(), v.float(), aux, scale)
    dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1))
    o.backward(dout)
    run = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": o.detach().to(torch_dtype),
           "dout": dout.to(torch_dtype), "lse": lse.detach(), **case.scalars, **{n: t.detach() for n, t in aux.items()},
           **({"_design": design.as_tuple()} if design else {})}
    kernel = TritonKernel.from_program(p, cache_dir)
    if longest_first:  # the host asks for it on a GPU only (a few waves of programs); here every launch does
        kernel.module._longest_first = lambda programs, device: True
    out = kernel.run(run)
    want = {"dq": q.grad, "dk": k.grad, "dv": v.grad, **{g: aux[n].grad for g, n in aux_gradients(p).items()}}
    assert set(out) == set(want), (sorted(out), sorted(want))
    for g, ref in want.items():
        assert out[g].dtype == (torch_dtype if g in ("dq", "dk", "dv") else torch.float32)
        assert torch.isfinite(out[g]).all(), g
        torch.testing.assert_close(out[g].float(), ref.float(), atol=tol, rtol=tol, msg=lambda m: f"{name} {g}: {m}")
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_autograd(name: str, cache_dir: Path) -> None:
    _check(name, cache_dir)


@pytest.mark.parametrize("name, kernel", [("causal_dq_pass", "bwd_dq"), ("softcap_gqa_dq_pass", "bwd_dq")])
def test_a_dq_swap_design_transposes_the_dq_pass_tile_not_its_gradients(name: str, kernel: str, cache_dir: Path) -> None:
    """Design.dq_swap launches the separate dq pass with BLOCK_M and BLOCK_N exchanged (16 query rows by 32 keys
    becomes 32 by 16, over lengths no tile divides); the gradients stay autograd's."""
    p = CASES[name].program()
    assert dq_swap_kernels(p) == (kernel,)
    src = lower_program(p)
    launch = src.split(f"_kb_launch(rec, {kernel_fn_name(next(k for k in p.kernels if k.name == kernel))},", 1)
    assert launch[0].rstrip().endswith("BLOCK_M, BLOCK_N = BLOCK_N, BLOCK_M") and src.count("design[7]") == 2
    swap = Design(16, 32, 4, 1, tma=False, dq_swap=True)
    assert parse_design(str(swap)) == swap and Design.from_tuple(swap.as_tuple()) == swap
    _check(name, cache_dir, M=37, N=45, design=swap)
    _check(name, cache_dir, M=37, N=45, design=dataclasses.replace(swap, dq_swap=False))


def test_without_a_separate_dq_pass_nothing_is_swapped() -> None:
    assert dq_swap_kernels(causal_bwd()) == () and "design[7]" not in lower_program(causal_bwd())


def test_fully_masked_rows_get_zero_gradients(cache_dir: Path) -> None:
    out = _check("empty_rows", cache_dir)
    assert torch.all(out["dq"][:, :, :3] == 0)  # lse = -inf rows: p = 0, never NaN


def test_bf16_inputs_give_bf16_gradients(cache_dir: Path) -> None:
    # P and dS enter the dots in bf16 (as in FlashAttention): bf16 tolerance against the fp32 reference
    _check("causal", cache_dir, dtype=Dtype.BF16, tol=3e-2)


def test_other_sizes(cache_dir: Path) -> None:
    # lengths that differ and head dim below the 16-wide padding; a q length not multiple of BLOCK_M
    _check("gqa", cache_dir, B=1, M=21, N=35, D=12, seed=3)


def test_scalar_bound_in_a_tile_mask(cache_dir: Path) -> None:
    # `rel[h % Hq, q_idx - kv_idx + ...]` puts a scalar bound (h % Hq < Hq) into a tile's load mask (the module's
    # interpreter fix) and guards the atomic scatter of drel with a scalar test
    base = CASES["rel_bias"]
    p = base.program()
    body = E("score + rel[h % Hq, q_idx - kv_idx + N - 1]")
    CASES["rel_mod"] = dataclasses.replace(base, program=lambda: dataclasses.replace(
        p, name="rel_mod_bwd", score_mod=dataclasses.replace(p.score_mod, body=body)))
    try:
        src = lower_program(CASES["rel_mod"].program())
        assert "mask=((h % Hq) < Hq) & (" in src and "if ((h % Hq) < Hq):" in src
        _check("rel_mod", cache_dir)
    finally:
        del CASES["rel_mod"]


# ------------------------------------------------------------------ autograd glue


def _forward_of(case: str) -> Program:
    if case == "rel_bias":
        return forward("rel_fwd", score_mod=REL, mask_mod="q_idx >= kv_idx", hi="minimum(N, m_start + BLOCK_M)",
                       aux=(Param("rel", ("Hq", "R"), Dtype.F32, Role.AUX),))
    return forward("causal_fwd", mask_mod="q_idx >= kv_idx", hi="minimum(N, m_start + BLOCK_M)", block_classes=True)


@pytest.mark.parametrize("name", ["causal", "rel_bias"])
def test_autograd_function_end_to_end(name: str, cache_dir: Path) -> None:
    """kb_attention's forward saves lse, its backward runs the backward kernels; a learnable table gets its grad."""
    case = CASES[name]
    mod, _ = load_module(lower_autograd(_forward_of(name), case.program()), f"glue_{name}", cache_dir)
    q, k, v, aux = _tensors(case, 2, 40, 40, 16, torch.float32, 5)
    o_ref, _ = _reference(case, q, k, v, aux, 0.25)
    dout = torch.randn_like(o_ref)
    o_ref.backward(dout)
    want = [t.grad.clone() for t in (q, k, v, *aux.values())]
    for t in (q, k, v, *aux.values()):
        t.grad = None
    o = mod.kb_attention(q, k, v, **aux)
    torch.testing.assert_close(o, o_ref.detach(), atol=1e-4, rtol=1e-4)
    o.backward(dout)
    for got, ref in zip((q.grad, k.grad, v.grad, *(t.grad for t in aux.values())), want):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.parametrize("cls", ["alibi", "causal", "document", "gqa", "prefix_lm", "relative_bias_learnable",
                                 "sliding_window", "softcap_gqa"])
def test_transferred_backward_trains_through_the_candidate(cls: str, tmp_path: Path) -> None:
    """kb generate's path: the rule engine's backward of a spec, lowered with its forward (lower_autograd), written as
    a KernelBench candidate whose ModelNew calls kb_attention; gradients (and the learnable table's) match the spec."""
    spec, fwd, bwd, _ = transferred_programs(CLASSES[cls])
    aux = [q.name for q in fwd.params if q.role is Role.AUX]
    files = write_candidate(spec, lower_autograd(fwd, bwd), aux, tmp_path, cls)
    spec_mod, cand = _import(SPECS / CLASSES[cls]), _import(files.candidate)
    torch.manual_seed(0)
    model, new = spec_mod.Model(*spec_mod.get_init_inputs()), cand.ModelNew(*spec_mod.get_init_inputs())
    new.load_state_dict(model.state_dict())
    ins = [t.float().requires_grad_() if t.is_floating_point() else t for t in spec_mod.get_inputs()]
    ref = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in ins]
    out = new(*ins)
    dout = torch.randn_like(out)
    out.backward(dout)
    model(*ref).backward(dout)
    for got, want in zip(ins, ref):
        if got.is_floating_point():
            torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)
    for (name, got), (_, want) in zip(sorted(new.named_parameters()), sorted(model.named_parameters())):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.network
def test_lifted_fa2_backward_programs_lower(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """The four backward programs ingest lifts from FA2's Triton `_bwd_kernel` run lowered as they run interpreted."""
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))
    programs = [lp.program for lp in fa2_triton_lift()[1].programs if lp.features.backward]
    assert len(programs) == 4
    B, H, M, N, D = 1, 2, 40, 40, 16
    q, k, v = (torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(n)) for n in (M, N, N + 1))
    v = v[:, :, :N]
    for p in programs:
        p = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, block_m=16, block_n=16, num_warps=4))
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if p.mask_mod is not None:
            s = s.masked_fill(torch.arange(M)[:, None] < torch.arange(N)[None, :], float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ v
        half = {"q": q, "k": k, "v": v, "o": o, "dout": torch.randn(o.shape, generator=torch.Generator().manual_seed(7))}
        ins = {**{n: t.to(torch.float16) for n, t in half.items()}, "lse": lse, "sm_scale": 1 / math.sqrt(D)}
        want, got = run_program(p, ins), TritonKernel.from_program(p, cache_dir).run(ins)
        for g in ("dq", "dk", "dv"):  # P and dS enter the lowered dots in fp16, the interpreter's in fp32
            torch.testing.assert_close(got[g].float(), want[g].float(), atol=1e-2, rtol=1e-2, msg=lambda m: f"{p.name} {g}: {m}")


def test_autograd_modules_check_the_pair() -> None:
    with pytest.raises(KBError, match="backward program"):
        check_pair(causal_bwd(), causal_bwd())
    no_lse = forward("x")
    no_lse = dataclasses.replace(no_lse, params=tuple(x for x in no_lse.params if x.name != "lse"))
    with pytest.raises(KBError, match="must write o and lse"):
        check_pair(no_lse, causal_bwd())
    with pytest.raises(KBError, match="needs softcap"):
        check_pair(forward("x"), CASES["softcap"].program())


# ------------------------------------------------------------------ refusals, source, compile


def test_unsupported_constructs_are_one_line_errors() -> None:
    p = causal_bwd()
    bf16_acc = dataclasses.replace(p, params=tuple(dataclasses.replace(x, dtype=Dtype.BF16) if x.name == "dq_acc" else x
                                                   for x in p.params))
    with pytest.raises(KBError, match="fp32 atomics") as err:
        lower_program(bf16_acc)
    assert "\n" not in str(err.value)
    reordered = dataclasses.replace(p, params=(p.params[1], p.params[0], *p.params[2:]))
    with pytest.raises(KBError, match="must be q, k, v, o, dout, lse"):
        lower_program(reordered)


def test_golden_source() -> None:
    src = lower_program(causal_bwd())
    path = GOLDEN / "causal_bwd.py"
    if UPDATE_GOLDEN:
        path.write_text(src)
    assert path.exists(), f"missing golden file {path}; run with KB_UPDATE_GOLDEN=1"
    assert src == path.read_text(), "generated source for causal_bwd changed; review and run with KB_UPDATE_GOLDEN=1"


def test_generated_code_shape_follows_fa2() -> None:
    src = lower_program(causal_bwd(dtype=Dtype.BF16))
    dkdv = src.split("def _bwd_dkdv_kernel(", 1)[1].split("@triton.jit", 1)[0]
    head, loop = dkdv.split("for h in range(", 1)
    assert "kt = " in head and "vt = " in head  # k, v loaded once per program, dk, dv accumulated in registers
    # score tiles held transposed (kv rows, q columns): P^T and dS^T enter the dV, dK dots as they are, in the
    # inputs' dtype, accumulating in fp32 registers
    assert "s = tl.dot(kt, tl.trans(qt))" in loop and "p = tl.exp2(sm * 1.4426950408889634 - _lse_log2[None, :])" in loop
    assert "dv_acc = tl.dot(p.to(gt.dtype), gt, dv_acc)" in loop
    assert "dk_acc = tl.dot(ds.to(qt.dtype), qt, dk_acc)" in loop
    assert 'tl.atomic_add(dq_acc_ptr + ' in loop and 'sem="relaxed")' in loop
    own = src.split("_BWD_PICKED = {}", 1)[1]  # what follows the shared preamble
    assert 'input_precision="ieee"' not in own and "USE_TMA" not in own  # descriptors measured slower here
    assert "dq_acc = _kb_alloc(rec, torch.zeros, " in src and "delta = _kb_alloc(rec, torch.empty, " in src  # accumulated: 0
    assert not any(isinstance(st, Store) and st.accumulate and st.tensor != "dq_acc"
                   for k in causal_bwd().kernels for st in walk_stmts(k.body))


@pytest.mark.parametrize("name, lists", [("causal", False), ("sliding_window", False), ("document", True)])
def test_the_query_loop_of_the_dkdv_kernel_is_split_by_block_class_when_the_design_asks(name: str, lists: bool) -> None:
    """With a block-class table the KV-outer query loop visits the table's lists per KV-block column (no empty blocks,
    full ones without mask code); with a closed-form mask it is emitted both ways under the SPLIT_Q constexpr
    (Design.q_split): split, its full blocks run without branch or mask (so Triton pipelines their loads), else every
    step stays under its block-class branch."""
    src = lower_program(CASES[name].program())
    dkdv = src.split("def _bwd_dkdv_kernel(", 1)[1].split("@triton.jit", 1)[0]
    assert ("qvl_ptr" in dkdv) == lists and ("SPLIT_Q" in dkdv) != lists
    if not lists:
        split, plain = dkdv.split("if SPLIT_Q:", 1)[1].split("else:  # every query block", 1)
        assert "query loop (KV-outer) split by block class" in split and "if not _is_full:" in plain
        assert "SPLIT_Q = len(design) > 8 and bool(design[8])" in src
    assert dkdv.count("_bwd_dkdv_q_block(") == (2 if lists else 3)  # the parts' loops share one body
    full = part_code(src, "_bwd_dkdv_q_block", full=True)
    assert "_is_empty" not in full and "_is_full" not in full and "sm = tl.where(" not in full
    assert "sm = tl.where(" in part_code(src, "_bwd_dkdv_q_block", full=False)


def test_split_partial_query_blocks_leave_empty_blocks_to_the_mask() -> None:
    """`if block is not empty` around a masked body: in the split loop's partial parts it is dropped (an empty block's
    scores are all masked, so it adds 0; the branch measured costly), in the unsplit loop it stays."""
    src = lower_program(CASES["empty_rows"].program())
    partial = part_code(src, "_bwd_dkdv_q_block", full=False)
    plain = src.split("def _bwd_dkdv_kernel(", 1)[1].split("else:  # every query block", 1)[1]
    assert "_is_empty" not in partial and "left to the mask" in partial and "if not _is_empty:" in plain


def test_a_gqa_group_loop_has_a_constant_trip_count() -> None:
    """The loop over a KV head's query heads runs GQA_GROUP = Hq // Hkv (a constexpr) times: one head per KV head
    folds the loop away."""
    src = lower_program(CASES["gqa"].program())
    assert "for h in range(hk * GQA_GROUP, hk * GQA_GROUP + GQA_GROUP, 1):" in src and "GQA_GROUP = Hq // Hkv" in src
    assert "(Hq // Hkv)" not in src.split("def _bwd_dkdv_kernel(", 1)[1].split("@triton.jit", 1)[0]


@pytest.mark.parametrize("name", ["causal", "sliding_window", "alibi", "gqa", "rel_bias", "causal_dq_pass", "empty_rows"])
def test_a_q_split_design_gives_autograds_gradients(name: str, cache_dir: Path) -> None:
    """The split query loop (partial, full, partial query blocks at each KV tile) over lengths no tile divides, with
    a KV tile wider and one narrower than the query tile."""
    for design in (Design(16, 32, 4, 1, tma=False, q_split=True), Design(32, 16, 4, 1, tma=False, q_split=True)):
        assert parse_design(str(design)) == design and Design.from_tuple(design.as_tuple()) == design
        _check(name, cache_dir, M=37, N=45, design=design)


def test_compiles_for_sm90() -> None:
    """The real Triton compiler (no GPU): every backward kernel compiles for sm_90 at D = 128 with bf16 inputs."""
    p = dataclasses.replace(CASES["rel_bias"].program(), schedule=dataclasses.replace(
        causal_bwd().schedule, block_m=64, block_n=64, num_warps=4, num_stages=2))
    p = dataclasses.replace(p, params=tuple(dataclasses.replace(x, dtype=Dtype.BF16)
                                            if x.name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv") else x for x in p.params))
    kernels = {k.name: k for k in compile_for_arch(p, arch=90, head_dim=128, timeout_s=240)}
    assert set(kernels) == {"bwd_preprocess", "bwd_dkdv", "bwd_dq"}
    assert kernels["bwd_dkdv"].wgmma > 0  # the five dots run on Hopper tensor cores


@pytest.mark.parametrize("block", [16, 32])
def test_a_relative_table_gradient_is_exact_whether_tiles_sum_per_entry_or_add_per_element(block: int,
                                                                                         cache_dir: Path) -> None:
    """rel[h, i - j + n - 1] in a 16x16 tile spans 31 table entries: each entry's products are summed in the tile
    before one atomic add; a 32x32 tile spans 63, more than the lowering bins, and adds element by element. Both
    give autograd's table gradient."""
    _, fwd, bwd, _ = transferred_programs("relative_bias_table.py")
    bwd = dataclasses.replace(bwd, schedule=dataclasses.replace(bwd.schedule, block_m=block, block_n=block))
    mod, path = load_module(lower_autograd(fwd, bwd), f"rel_bins_{block}", cache_dir)
    # (the 16x16 module is the one other tests build too: its operator, registered once per process, may be theirs)
    assert "for _bin in range(_lo, _hi + 1):" in path.read_text() and f"BWD_PROGRAM_DESIGN = ({block}, {block}," in path.read_text()
    assert "one read of the table" not in path.read_text()  # i - j + n - 1 is one-to-one: no tile-uniform test
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 64, requires_grad=True) for _ in range(3))
    rel = torch.nn.Parameter(torch.randn(4, 127) * 0.3)
    mod.kb_attention(q, k, v, rel=rel).sum().backward()
    got, rel.grad = rel.grad, None
    idx = torch.arange(64)[:, None] - torch.arange(64)[None, :] + 63
    (torch.softmax(q @ k.transpose(-2, -1) / 8 + rel[:, idx].unsqueeze(0), -1) @ v).sum().backward()
    torch.testing.assert_close(got, rel.grad, atol=2e-5, rtol=2e-5)


def test_a_t5_bucket_one_value_over_a_tile_reads_the_table_once_and_sums_its_gradient_once(cache_dir: Path) -> None:
    """T5 buckets saturate past their largest distance (15 here), so most tiles (16x32, 32x16) of 96 tokens see one
    bucket: the lowering tests that from the index's bounds (kb.ir.interval) and then reads the table once and adds
    the tile's whole dS to its gradient in one atomic; the other tiles keep the per-element path. Output and every
    gradient match the spec Model's autograd."""
    import importlib.util as iu  # noqa: PLC0415  the spec module is loaded from its file, as tracing does

    _, fwd, bwd, _ = transferred_programs("t5_bucket_bias.py")
    fwd = dataclasses.replace(fwd, schedule=dataclasses.replace(fwd.schedule, block_m=16, block_n=32))
    bwd = dataclasses.replace(bwd, schedule=dataclasses.replace(bwd.schedule, block_m=32, block_n=16))
    mod, path = load_module(lower_autograd(fwd, bwd), "t5_uniform_tiles", cache_dir)
    text = path.read_text()
    assert text.count("one read of the table") >= 3  # the forward's KV loop, the dK/dV kernel and the dq work
    assert "the index is one value over this tile: one sum, one atomic" in text
    spec = iu.spec_from_file_location("t5_spec", SPECS / "t5_bucket_bias.py")
    assert spec is not None and spec.loader is not None
    m = iu.module_from_spec(spec)
    spec.loader.exec_module(m)
    torch.manual_seed(0)
    model = m.Model(2)
    q, k, v = (torch.randn(1, 2, 96, 16, requires_grad=True) for _ in range(3))
    aux = next(p.name for p in fwd.params if p.role is Role.AUX)
    table = torch.nn.Parameter(model.rel.weight.detach().clone())
    dout = torch.randn(1, 2, 96, 16)
    o = mod.kb_attention(q, k, v, **{aux: table})
    got = torch.autograd.grad(o, (q, k, v, table), dout)
    want_o = model(q, k, v)
    want = torch.autograd.grad(want_o, (q, k, v, model.rel.weight), dout)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=2e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=5e-5)


def test_a_dq_pass_walking_a_gqa_group_is_launched_per_query_head() -> None:
    """The dq pass's loop over a KV head's query heads becomes the grid (`kb.lower.group_grid`): its launch covers Hq,
    not Hkv; the dK/dV kernel, which sums over the group, keeps its loop (test_gradients_match_autograd checks
    both at Hq = 6, Hkv = 2)."""
    from kb.lower.group_grid import spread_group_loops  # noqa: PLC0415  the pass under test, beside its lowering

    p = CASES["gqa_group_dq_pass"].program()
    spread = {k.name: k for k in spread_group_loops(p).kernels}
    kept = {k.name: k for k in p.kernels}
    assert [ax.name for ax in kept["bwd_dq"].grid] == ["b", "hk", "m"]
    assert [ax.name for ax in spread["bwd_dq"].grid] == ["b", "h", "m"]
    assert isinstance(spread["bwd_dq"].body[0], Let) and spread["bwd_dq"].body[0].name == "hk"
    assert spread["bwd_dkdv"] is kept["bwd_dkdv"]
    src = lower_program(p)
    assert "_kb_launch(rec, _bwd_dq_kernel, (B * Hq * " in src and "_kb_launch(rec, _bwd_dkdv_kernel, (B * Hkv * " in src


@pytest.mark.parametrize("name", ["causal", "gqa", "causal_dq_pass", "gqa_group_dq_pass", "document", "empty_rows"])
def test_longest_first_program_order_gives_the_same_gradients(name: str, cache_dir: Path) -> None:
    """HEAVY_FIRST walks the grid block index slowest (a dK/dV kernel's first KV block, a dq pass's last query block
    first): the same programs in another order, over lengths no tile divides."""
    _check(name, cache_dir, M=37, N=45, longest_first=True)


def test_only_kernels_whose_loops_one_end_moves_get_the_longest_first_order() -> None:
    """A causal dK/dV kernel (its query loop starts at the KV block) and dq pass (its KV loop ends at the query
    block) get the HEAVY_FIRST branch; the preprocess kernel (no loop) does not, nor does a window's dK/dV kernel
    (both ends move: every program about as long)."""
    def kernels(src: str) -> dict[str, str]:
        return {m.split("(", 1)[0]: m for m in src.split("def _bwd_")[1:]}

    causal = kernels(lower_program(CASES["causal_dq_pass"].program()))
    assert "if HEAVY_FIRST:" in causal["dkdv_kernel"] and "if HEAVY_FIRST:" in causal["dq_kernel"]
    assert "if HEAVY_FIRST:" not in causal["preprocess_kernel"]
    window = lower_program(backward("window_bwd", mask_mod="(q_idx >= kv_idx) & (q_idx - kv_idx < 8)",
                                    m_lo=SLIDE, m_hi="minimum(M, n_start + BLOCK_N + 8)"))
    assert "if HEAVY_FIRST:" not in kernels(window)["dkdv_kernel"]
