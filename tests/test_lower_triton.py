"""Triton lowering: every fixture program runs under the Triton interpreter and matches the dense oracle.

Also: golden generated sources (regenerate with KB_UPDATE_GOLDEN=1), closed-form block classes
checked against the dense host table, floor semantics of // and %, fully masked rows,
reverse KV order, non-contiguous inputs, and the module importing under the real JIT.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kb.errors import KBError
from kb.ir.evaluate import eval_expr
from kb.ir.nodes import Dtype, For, IfBlock, Param, Program, Role
from kb.lower.runtime import TritonKernel, load_module
from kb.lower.block_mask import BlockMaskKind, _block_tests, plan_block_mask
from kb.lower.triton import LowerOptions, lower_program
from tests.support.attn_reference import dense_block_classes, reference_attention
from tests.support.ir_programs import FIXTURES, forward
from tests.support.split_parts import helper_source

GOLDEN = Path(__file__).parent / "golden" / "triton"
UPDATE_GOLDEN = os.environ.get("KB_UPDATE_GOLDEN") == "1"  # read at import: conftest clears KB_* per test
TOL = {Dtype.F32: 1e-4, Dtype.BF16: 2e-2}
TORCH = {Dtype.F32: torch.float32, Dtype.BF16: torch.bfloat16}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton_cache")


def _inputs(p: Program, B: int, Hq: int, Hkv: int, M: int, N: int, D: int, dtype: torch.dtype, seed: int = 0,
            doc_ids: torch.Tensor | None = None) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    qkv = {"q": torch.randn(B, Hq, M, D, generator=g).to(dtype),
           "k": torch.randn(B, Hkv, N, D, generator=g).to(dtype),
           "v": torch.randn(B, Hkv, N, D, generator=g).to(dtype)}
    scalars = {q.name: 2.5 for q in p.params if q.role is Role.SCALAR and q.name != "sm_scale"}
    aux: dict[str, torch.Tensor] = {}
    for q in p.params:
        if q.name == "slopes":
            aux["slopes"] = torch.rand(Hq, generator=g)
        elif q.name == "doc_ids":
            aux["doc_ids"] = doc_ids if doc_ids is not None else \
                torch.sort(torch.randint(0, 3, (B, N), generator=g), dim=1).values.to(torch.int32)
    return qkv, scalars, aux


def _check(p: Program, cache_dir: Path, *, B: int = 2, Hq: int = 2, Hkv: int = 2, M: int = 37, N: int = 29,
           D: int = 24, dtype: Dtype = Dtype.F32, qkv: dict | None = None, **kw) -> dict[str, torch.Tensor]:
    gen_qkv, scalars, aux = _inputs(p, B, Hq, Hkv, M, N, D, TORCH[dtype], **kw)
    qkv = qkv or gen_qkv
    out = TritonKernel.from_program(p, cache_dir).run({**qkv, **scalars, **aux})
    o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], scalars=scalars, aux=aux)
    assert not torch.isnan(out["o"]).any() and not torch.isnan(out["lse"]).any()
    tol = TOL[dtype]
    torch.testing.assert_close(out["o"].float(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out["lse"], lse_ref, atol=tol, rtol=tol)  # -inf must match -inf exactly
    return out


# ------------------------------------------------------------------ fixtures vs oracle

SHAPES = {  # ragged: no length is a multiple of the 16-wide blocks; document needs M <= N (doc_ids is [B, N])
    "gqa": dict(Hq=4, Hkv=2),
    "document": dict(M=29, N=37),
    "decode_split_kv": dict(M=3, N=45, D=16),
}


@pytest.mark.parametrize("dtype", [Dtype.F32, Dtype.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_matches_reference(name: str, dtype: Dtype, cache_dir: Path) -> None:
    _check(FIXTURES[name](dtype=dtype), cache_dir, dtype=dtype, **SHAPES.get(name, {}))


def test_decode_single_query_and_empty_splits(cache_dir: Path) -> None:
    # M = 1 (decode), N smaller than NUM_SPLITS blocks: some splits see no keys and must weigh 0
    _check(FIXTURES["decode_split_kv"](), cache_dir, B=1, Hq=3, Hkv=1, M=1, N=17, D=16)


# ------------------------------------------------------------------ edge cases


def test_fully_masked_rows_closed_form(cache_dir: Path) -> None:
    p = forward("late_start", mask_mod="q_idx - kv_idx >= 20", block_classes=True)
    assert plan_block_mask(p).kind is BlockMaskKind.ANALYTIC
    out = _check(p, cache_dir, M=33, N=33)
    assert torch.all(out["o"][:, :, :20] == 0) and torch.all(out["lse"][:, :, :20] == float("-inf"))


def test_fully_masked_rows_host_table(cache_dir: Path) -> None:
    p = forward("doc_shifted", mask_mod="(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx + 3)",
                aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),), block_classes=True)
    assert plan_block_mask(p) == dataclasses.replace(plan_block_mask(p), kind=BlockMaskKind.TABLE, per_b=True, per_h=False)
    doc = torch.tensor([[0] * 10 + [1] * 20 + [2] * 5, [0] * 35]).to(torch.int32)
    out = _check(p, cache_dir, M=35, N=35, doc_ids=doc)
    assert torch.all(out["lse"][0, :, 10:13] == float("-inf")) and torch.all(out["o"][0, :, 10:13] == 0)


def test_floor_division_and_modulo_on_negative_operands(cache_dir: Path) -> None:
    # kv_idx - q_idx is negative below the diagonal; C-style truncation would give other values
    p = forward("floor_bias", score_mod="score + ((kv_idx - q_idx) // 5) * 0.25 + ((kv_idx - q_idx) % 3) * 0.5")
    assert "_floordiv(" in lower_program(p) and "_floormod(" in lower_program(p)
    _check(p, cache_dir, M=21, N=19)


def test_trunc_rounds_toward_zero_in_arithmetic_and_load_indices(cache_dir: Path) -> None:
    # (kv_idx - q_idx) / 4 is negative below the diagonal: trunc(-2.25) = -2, where floor would give -3;
    # slopes[trunc(|kv_idx - q_idx| / 16.0)] reads entry 0 below distance 16, entry 1 from there
    p = forward("trunc_bias", score_mod="score + trunc((kv_idx - q_idx) / 4) * 0.25 + trunc(-0.3 * (kv_idx - q_idx)) * 0.125"
                                        " + slopes[trunc(abs(kv_idx - q_idx) / 16.0)]",
                aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),))
    assert ".to(tl.int32)" in lower_program(p)
    _check(p, cache_dir, M=21, N=19)


def test_reverse_kv_order(cache_dir: Path) -> None:
    p = FIXTURES["sliding_window"]()
    fwd = p.kernels[0]
    body = tuple(dataclasses.replace(st, order="reverse") if isinstance(st, For) else st for st in fwd.body)
    p = dataclasses.replace(p, name="sliding_window_rev", kernels=(dataclasses.replace(fwd, body=body),))
    _check(p, cache_dir, M=40, N=40)


def test_non_contiguous_inputs(cache_dir: Path) -> None:
    B, Hq, M, N, D = 2, 2, 19, 23, 16
    g = torch.Generator().manual_seed(3)
    qkv = {"q": torch.randn(B, M, Hq, D, generator=g).transpose(1, 2),  # [B, Hq, M, D] view, strided
           "k": torch.randn(B, Hq, D, N, generator=g).transpose(2, 3),
           "v": torch.randn(B, N, Hq, 2 * D, generator=g).transpose(1, 2)[..., ::2]}
    assert not any(t.is_contiguous() for t in qkv.values())
    _check(FIXTURES["causal"](), cache_dir, B=B, Hq=Hq, Hkv=Hq, M=M, N=N, D=D, qkv=qkv)


def test_missing_aux_tensor_is_a_user_error(cache_dir: Path) -> None:
    kernel = TritonKernel.from_program(FIXTURES["alibi"](), cache_dir)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(KBError, match="slopes"):
        kernel.run({"q": q, "k": q, "v": q})


# ------------------------------------------------------------------ block classes


BLOCK_MASKS = [
    "q_idx >= kv_idx",
    "(q_idx >= kv_idx) & (q_idx - kv_idx < 24)",
    "q_idx + (N - M) >= kv_idx",
    "kv_idx < q_idx + 5",
    "(kv_idx - q_idx > 3) & (2 >= kv_idx - q_idx - 7)",
    "kv_idx <= 17",
    "q_idx == kv_idx",
    "(q_idx >= kv_idx) & (kv_idx < 21)",  # two forms: a packed sequence's causal bound and its end
    "(q_idx + 3 >= kv_idx) & (q_idx < 30) & (kv_idx >= 5)",
]


@pytest.mark.parametrize("mask", BLOCK_MASKS)
def test_closed_form_block_classes_equal_dense_table(mask: str, cache_dir: Path) -> None:
    p = forward("bc", mask_mod=mask, block_classes=True)
    plan = plan_block_mask(p)
    assert plan.kind is BlockMaskKind.ANALYTIC
    ifb = next(st for st in p.kernels[0].body[-4].body if isinstance(st, IfBlock))
    BM, BN = p.schedule.block_m, p.schedule.block_n
    for M, N in [(37, 29), (16, 48), (50, 50)]:
        env = {"B": 1, "Hq": 1, "Hkv": 1, "M": M, "N": N, "D": 16, "BLOCK_M": BM, "BLOCK_N": BN, "b": 0, "h": 0}
        dense = dense_block_classes(lambda q_idx, kv_idx: eval_expr(p.mask_mod.body, {**env, "q_idx": q_idx,
                                    "kv_idx": kv_idx}), M, N, BM, BN)
        is_empty, is_full = _block_tests(plan, ifb, "M", "N")
        for mi, ni in itertools.product(range(dense.shape[0]), range(dense.shape[1])):
            at = {**env, "m_start": mi * BM, "n_start": ni * BN}
            want = int(dense[mi, ni])
            got = 0 if eval_expr(is_empty, at) else 2 if eval_expr(is_full, at) else 1
            # exact for bounds on one form; over several, an empty tile may be called partial (its mask code runs)
            assert got == want or (got, want) == (1, 0) and any(len(c) > 1 for c in plan.disjuncts), (mask, M, N, mi, ni)


def test_block_mask_plans() -> None:
    assert plan_block_mask(FIXTURES["plain"]()).kind is BlockMaskKind.NO_MASK
    causal = plan_block_mask(FIXTURES["causal"]())
    assert (causal.kind, [[(d.alpha, d.beta) for d in c] for c in causal.disjuncts]) == (BlockMaskKind.ANALYTIC, [[(1, -1)]])
    doc = plan_block_mask(FIXTURES["document"]())
    assert (doc.kind, doc.per_b, doc.per_h) == (BlockMaskKind.TABLE, True, False)
    two_forms = plan_block_mask(forward("x", mask_mod="(q_idx >= kv_idx) & (kv_idx < 7)"))
    assert [[(d.alpha, d.beta) for d in c] for c in two_forms.disjuncts] == [[(1, -1), (0, 1)]]
    assert plan_block_mask(forward("x", mask_mod="(q_idx >= kv_idx) & (2 * kv_idx < 7)")).kind is BlockMaskKind.TABLE


def test_host_table_used_when_not_closed_form(cache_dir: Path) -> None:
    p = forward("two_dirs", mask_mod="(q_idx >= kv_idx) & (kv_idx + 2 * q_idx < 40)", block_classes=True)
    src = lower_program(p)
    assert "_hblock_classes(" in src and "bc_ptr" in src
    _check(p, cache_dir, M=33, N=35)


# ------------------------------------------------------------------ source


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_golden_source(name: str) -> None:
    src = lower_program(FIXTURES[name]())
    path = GOLDEN / f"{name}.py"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    assert path.exists(), f"missing golden file {path}; run with KB_UPDATE_GOLDEN=1"
    assert src == path.read_text(), f"generated source for {name} changed; review and run with KB_UPDATE_GOLDEN=1"


def test_generated_code_shape_follows_fa2() -> None:
    # the unsplit, unfolded shape (the speed options are checked below)
    src = lower_program(FIXTURES["causal"](dtype=Dtype.BF16), LowerOptions(split_kv_loop=False, fold_scale=False))
    assert "for n_start in range(0, tl.minimum(N, (m_start + BLOCK_M)), BLOCK_N):" in src  # IR's exact loop bounds
    assert "tl.dot(_p.to(vt.dtype), vt, acc * _alpha[:, None])" in src  # p in v's dtype, fp32 acc
    assert "tl.exp2(s * 1.4426950408889634 - _m_log2[:, None])" in src  # log2(e) folded into one FMA
    assert "num_warps=num_warps, num_stages=num_stages" in src and "BLOCK_M: tl.constexpr" in src
    assert "PROGRAM_DESIGN = (16, 16, 1, 4, 1, True, False)" in src  # the program's schedule, for the interpreter
    assert 'input_precision="ieee"' not in src  # only fp32 programs ask for exact fp32 dots
    fast = lower_program(FIXTURES["causal"](dtype=Dtype.BF16))
    assert "_kv_hi_n_start = tl.minimum(N, (m_start + BLOCK_M))" in fast  # split loops keep the IR's bounds
    assert fast.count("for n_start in range(") == 3 and "# full blocks" in fast
    assert "tl.exp2(s * _qk_scale - _m_log2[:, None])" in fast  # sm_scale * log2(e) in one FMA


def test_hopper_tma_form() -> None:
    """Descriptor forms sit beside the masked forms, K/V descriptors are built once before the KV
    loops, and the portable path (no USE_TMA) is the only one the interpreter ever takes."""
    fast = lower_program(FIXTURES["causal"](dtype=Dtype.BF16))
    head, loops = fast.split("# KV loop split", 1)
    assert "_desc_q = tl.make_tensor_descriptor(q_ptr + b * stride_q_0 + h * stride_q_1, shape=[M, D]" in head
    pre = loops.split("for n_start in", 1)[0]
    assert "_desc_k = tl.make_tensor_descriptor(" in pre and "_desc_v = tl.make_tensor_descriptor(" in pre
    body = helper_source(fast, "_fwd_kv_block")  # the KV loop's body, once for its three parts
    assert body.count("kt = _desc_k.load([n_start, 0]) if USE_TMA else tl.load(") == 2  # a full and a partial form
    assert fast.count("= _fwd_kv_block(n_start, ") == 3
    assert "_desc_o.store([m_start, 0], ot.to(o_ptr.dtype.element_ty))" in fast
    assert "USE_TMA = tma and _use_tma((q, k, v, o), (BLOCK_M, BLOCK_N, HEAD_PAD))" in fast
    off = lower_program(FIXTURES["causal"](dtype=Dtype.BF16), LowerOptions(tma=False))
    assert "USE_TMA:" not in off and "tl.make_tensor_descriptor" not in off and "for n_start in range(" in off
    ws = lower_program(FIXTURES["causal"](dtype=Dtype.BF16), LowerOptions(warp_specialize=True))
    assert ws.count("tl.range(") == 3 and "warp_specialize=WARP_SPEC" in ws and "WARP_SPEC = USE_TMA and False" in ws
    mod, _ = load_module(fast, "causal_tma_cpu")
    assert mod._use_tma((torch.zeros(4, 4),), (16, 16, 16)) is False  # CPU tensors / interpreter: portable path


def test_module_imports_under_real_jit(tmp_path: Path) -> None:
    """Without the interpreter, `triton.jit` parses each kernel's source into a JITFunction."""
    script = (
        "import sys; from pathlib import Path\n"
        "from triton.runtime.jit import JITFunction\n"
        "from kb.lower.runtime import TritonKernel\n"
        "from tests.support.ir_programs import FIXTURES\n"
        "for name, build in FIXTURES.items():\n"
        "    k = TritonKernel.from_program(build(), Path(sys.argv[1]))\n"
        "    fns = k.jit_functions\n"
        "    assert fns and all(isinstance(f, JITFunction) for f in fns.values()), (name, fns)\n"
        "    assert all(f.arg_names[:2] == ['q_ptr', 'k_ptr'] for f in fns.values())\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_interpreter_kernels_exist(cache_dir: Path) -> None:
    k = TritonKernel.from_program(FIXTURES["decode_split_kv"](), cache_dir)
    assert set(k.jit_functions) == {"split", "combine"}
    assert k.path.exists() and k.path.read_text() == k.source


def test_module_cache_is_keyed_by_interpreter_mode(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`@triton.jit` picks interpreter or compiler when the module is imported, so one source imported in
    both modes gives two modules; a module made for the interpreter is never handed to a compiled launch."""
    source = lower_program(FIXTURES["causal"]())
    interp, _ = load_module(source, "mode_key", cache_dir)
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled, _ = load_module(source, "mode_key", cache_dir)
    assert interp is not compiled and interp.__name__.endswith("_interp") and not compiled.__name__.endswith("_interp")
    assert type(compiled._fwd_kernel).__name__ == "JITFunction"
    assert type(interp._fwd_kernel).__name__ == "InterpretedFunction"
