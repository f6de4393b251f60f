"""Hopper lowering from the IR: the template's hooks are generated from a Program; nvcc builds them for sm_90a
with wgmma/TMA and no spills; programs the template cannot compute are declined with the reason.

Correctness on a GPU: `python3 bench/cuda_check.py --sm90` (fixtures at D=64/128, ragged shapes, bf16 and fp16).
"""

from __future__ import annotations

import dataclasses
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from kb.errors import KBError
from kb.ir.expr import Expr, call, parse_expr, substitute, var
from kb.ir.nodes import Dtype, For, TileAt
from kb.lower.cuda_dispatch import CudaDispatch, dispatch_section
from kb.lower.cuda_sm90_ir import abi_program, hopper_program, lower_program_sm90
from tests.support.cuda import build_sm90a, nvcc_or_skip
from tests.support.ir_programs import FIXTURES


def _two_loops(name: str):
    """The fixture with its KV loop split in two at a BLOCK_N-aligned point (AMD's full-then-masked loops)."""
    p = FIXTURES[name](dtype=Dtype.BF16)
    k = p.kernels[0]
    i = next(j for j, s in enumerate(k.body) if isinstance(s, For))
    f = k.body[i]

    mid = parse_expr("minimum(N, BLOCK_N)")
    first = dataclasses.replace(f, hi=call("minimum", f.hi, mid))
    body2 = tuple(_rename(s, f.var, "n2") for s in f.body)
    second = dataclasses.replace(f, var="n2", lo=call("maximum", f.lo, mid), body=body2)
    return dataclasses.replace(p, kernels=(dataclasses.replace(k, body=k.body[:i] + (first, second) + k.body[i + 1:]),))


def _rename(st, old: str, new: str):
    changes = {}
    for fld in dataclasses.fields(st):
        v = getattr(st, fld.name)
        if isinstance(v, Expr):
            changes[fld.name] = substitute(v, {old: var(new)})
        elif isinstance(v, TileAt):
            changes[fld.name] = TileAt(*(substitute(e, {old: var(new)}) for e in v))
        elif isinstance(v, tuple) and v and all(hasattr(x, "op") and not isinstance(x, Expr) for x in v):
            changes[fld.name] = tuple(_rename(x, old, new) for x in v)
        elif fld.name == "index":
            changes[fld.name] = tuple(dataclasses.replace(ix, start=substitute(ix.start, {old: var(new)}))
                                      if hasattr(ix, "start") else ix for ix in v)
    return dataclasses.replace(st, **changes)


HOOK_CASES = [("causal", 128), ("causal", 64), ("document", 128), ("alibi", 128), ("softcap", 64), ("two_loops", 128)]


@pytest.fixture(scope="module")
def hook_builds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each case's (source, PTX text, ptxas log of the object build), built once and in parallel."""
    nvcc = nvcc_or_skip()
    root = tmp_path_factory.mktemp("sm90")

    def one(case: tuple[str, int]) -> tuple[str, str, str]:
        name, head_dim = case
        p = _two_loops("alibi") if name == "two_loops" else FIXTURES[name](dtype=Dtype.BF16)
        src = lower_program_sm90(p, head_dim)
        return (src, *build_sm90a(nvcc, src, root / f"{name}_{head_dim}"))

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(HOOK_CASES, pool.map(one, HOOK_CASES)))


@pytest.mark.parametrize("name, head_dim", HOOK_CASES)
def test_generated_hooks_build_for_sm90a_on_wgmma_without_spills(hook_builds: dict, name: str, head_dim: int) -> None:
    src, ptx, log = hook_builds[(name, head_dim)]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    spills = re.findall(r"Compiling entry function '(\w*kb_sm90_fwd\w*)'.*?(\d+) bytes spill stores", log, re.S)
    assert spills and all(s == "0" for _, s in spills), log
    if name == "two_loops":
        assert "kb_lo1" in src and "__trap()" in src  # the union of the loops, and a loud stop off the tile grid


def test_hooks_follow_the_ir() -> None:
    src = lower_program_sm90(FIXTURES["document"](dtype=Dtype.BF16), 128)
    assert "kb_block_class_kernel" in src and "kb_table_class" in src  # data-dependent: the block-class table
    causal = lower_program_sm90(FIXTURES["causal"](dtype=Dtype.BF16), 64)
    assert "#define KB_HEAD_DIM 64" in causal and "kb_launch" in causal


def _hook(src: str, name: str) -> str:
    start = src.index(f" {name}(const KbArgs& kb_a")
    return src[start:src.index("\n}\n", start)]


def test_hook_pieces_are_split_by_what_they_read() -> None:
    """A piece of the score reading only (b, h) is computed per head (kb_row_head: ALiBi's slope), one reading only
    the key per key (kb_col: a key's document id), one reading only the query per query row (kb_row_at); the
    backward calls them once per step or column (kb.lower.cuda_sm90_bwd), the per-element hook combines them."""
    alibi = lower_program_sm90(FIXTURES["alibi"](dtype=Dtype.BF16), 128, backward=True)
    assert "slopes[" in _hook(alibi, "kb_row_head") and "slopes[" not in _hook(alibi, "kb_score_at")
    assert "slopes[" not in _hook(alibi, "kb_row_at")
    doc = lower_program_sm90(FIXTURES["document"](dtype=Dtype.BF16), 128, backward=True)
    assert "kv_idx * kb_a.doc_ids_stride" in _hook(doc, "kb_col") and "q_idx * kb_a.doc_ids_stride" in _hook(doc, "kb_row_at")
    assert "doc_ids[" not in _hook(doc, "kb_score_at") and "doc_ids[" not in _hook(doc, "kb_row_head")
    assert "kb_score_at(a, kb_row_at(a, head, q), col[e / 2]" in doc


@pytest.mark.parametrize("name, dtype, head_dim, why", [
    ("decode_split_kv", Dtype.BF16, 128, "outputs other than o and lse"),
    ("mixed", Dtype.F16, 128, "all be bf16 or all fp16"),
    ("causal", Dtype.BF16, 96, "head dim 96"),
    ("fp32_out", Dtype.BF16, 128, "the kernel stores o in q's type"),
])
def test_programs_the_template_cannot_compute_are_declined(name: str, dtype: Dtype, head_dim: int, why: str) -> None:
    if name == "fp32_out":  # bf16 in, fp32 out (a spec that asks for fp32 accuracy)
        p = FIXTURES["causal"](dtype=dtype)
        p = dataclasses.replace(p, params=tuple(dataclasses.replace(x, dtype=Dtype.F32) if x.name == "o" else x
                                                for x in p.params))
    elif name == "mixed":  # fp16 q and o, bf16 k and v
        p = FIXTURES["causal"](dtype=dtype)
        p = dataclasses.replace(p, params=tuple(dataclasses.replace(x, dtype=Dtype.BF16) if x.name in "kv" else x
                                                for x in p.params))
    else:
        p = FIXTURES[name](dtype=dtype)
    with pytest.raises(KBError, match=why):
        lower_program_sm90(p, head_dim)


def test_a_program_traced_in_fp32_is_lowered_for_bf16_and_its_dispatch_takes_bf16_only() -> None:
    """A spec traced in fp32 (q, k, v, o all fp32; its Triton module follows the inputs' dtype) gets the Hopper
    template in bf16, what the module runs for bf16 inputs; the dispatch's ABI says bf16, so fp32 inputs keep the
    Triton kernels. A deliberate fp32 output stays declined (above)."""
    p = FIXTURES["causal"](dtype=Dtype.F32)
    src = lower_program_sm90(p, 128, backward=True)
    assert "const __nv_bfloat16* q;" in src and "typedef __nv_bfloat16 kb_elem;" in src
    assert {x.name: x.dtype for x in abi_program(p, src).params if x.name in "qkvo"} == dict.fromkeys("qkvo", Dtype.BF16)
    assert hopper_program(FIXTURES["causal"](dtype=Dtype.BF16)) == FIXTURES["causal"](dtype=Dtype.BF16)
    lines = "\n".join(dispatch_section(p, src, CudaDispatch("x.cu", src, "sm_90a", {"sm90": {128: "measured"}})))
    abi = lines[lines.index("_CUDA_ABI = "):].splitlines()[0]
    assert "('q', 'in', ('B', 'Hq', 'M', 'D'), 'bf16')" in abi and "'f32'" not in abi.split("'lse'")[0]


def test_loads_of_the_wrong_kv_head_are_declined() -> None:
    p = FIXTURES["gqa"](dtype=Dtype.BF16)
    text = p.kernels[0]
    loop = next(s for s in text.body if isinstance(s, For))
    k_load = loop.body[0]

    wrong = dataclasses.replace(k_load, index=(k_load.index[0], var("h")) + k_load.index[2:])  # k[b, h, ...]: not GQA
    body = tuple(dataclasses.replace(loop, body=(wrong,) + loop.body[1:]) if s is loop else s for s in text.body)
    p = dataclasses.replace(p, kernels=(dataclasses.replace(text, body=body),))
    with pytest.raises(KBError, match=r"addresses"):
        lower_program_sm90(p, 128)
