"""Data-dependent masks at block-sparse speed, in every layout users write.

Document ids as [S] shared by the batch, as [B, S], or in a FlexAttention mask_mod over a module-level id
tensor; prefix-LM with a Python constant, a 0-d tensor or a per-batch [B] prefix: each generates and verifies.
The block table of a data-dependent mask is filled on the GPU by the module's class kernel, once per mask
(reused across calls with equal inputs, rebuilt when they change); loads that do not move along the KV loop
are hoisted out of it; closed-form masks (a constant or per-batch prefix) get no table at all; document ids
from offsets (`torch.searchsorted(offsets, arange(S), right=True)` in the Model) are computed by the candidate
from the offsets before the launch; other uses of searchsorted are refused with a message naming the construct.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from kb.errors import KBError
from kb.ir.design import Design
from kb.ir.evaluate import eval_expr
from kb.ir.nodes import Dtype, For, Param, Role
from kb.lower.runtime import TritonKernel
from kb.lower.block_mask import BlockMaskKind, plan_block_mask
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch
from tests.support.attn_reference import dense_block_classes, reference_attention
from tests.support.ir_programs import forward
from tests.support.generate_fixtures import QUICK
from tests.support.split_parts import helper_source


_HEAD = '''import math
import torch
import torch.nn as nn
B, H, S, D = 2, 2, 100, 32
'''
_MODEL = '''
class Model(nn.Module):
    def forward(self, q, k, v{extra}):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        s = s.masked_fill(~({keep}), float("-inf"))
        return (s.softmax(-1) @ v.float()).to(q.dtype)
def get_inputs():
    return [torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3)]{inputs}
def get_init_inputs():
    return []
'''
_DOC_1D = "torch.repeat_interleave(torch.arange(3), torch.tensor([30, 45, 25])).to(torch.int32)"
SPECS = {
    "doc_1d": _HEAD + _MODEL.format(extra=", doc", keep="(doc[:, None] == doc[None, :]) & (j <= i)",
                                    inputs=f" + [{_DOC_1D}]"),
    "doc_2d": _HEAD + _MODEL.format(extra=", doc", keep="(doc[:, None, :, None] == doc[:, None, None, :]) & (j <= i)",
                                    inputs=f" + [torch.stack([{_DOC_1D}, {_DOC_1D}.flip(0)])]"),
    "doc_flex": '''import torch
SHAPES = dict(B=2, Hq=2, Hkv=2, M=100, N=100, D=32, dtype="bf16")
OFFSETS = torch.tensor([0, 30, 75, 100])
DOC = torch.searchsorted(OFFSETS, torch.arange(100), right=True) - 1  # ids derived from offsets, once
def mask_mod(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)
''',
    "doc_offsets": _HEAD + _MODEL.format(
        extra=", offsets", keep="(doc[:, None] == doc[None, :]) & (j <= i)",
        inputs=" + [torch.tensor([0, 37, 81, 100], dtype=torch.int32)]",
    ).replace("        i = torch.arange", "        doc = torch.searchsorted(offsets, torch.arange(q.shape[2], dtype=torch.int32), "
              "right=True) - 1\n        i = torch.arange", 1),
    "prefix_const": _HEAD + _MODEL.format(extra="", keep="(j < 40) | (j <= i)", inputs=""),
    "prefix_0d": _HEAD + _MODEL.format(extra=", prefix", keep="(j < prefix) | (j <= i)",
                                       inputs=" + [torch.tensor(37, dtype=torch.int32)]"),
    "prefix_b": _HEAD + _MODEL.format(extra=", prefix", keep="((j[None] < prefix[:, None, None]) | (j <= i)[None])[:, None]",
                                      inputs=" + [torch.tensor([20, 70], dtype=torch.int32)]"),
}
NEEDS_TABLE = {"doc_1d": True, "doc_offsets": True, "doc_2d": True, "doc_flex": True, "prefix_const": False, "prefix_0d": False, "prefix_b": False}


@pytest.mark.network  # the session KB ingests the real flash-attn release
# every layout but the plain constant prefix (prefix_lm specs generate elsewhere) and the FlexAttention-style one
# (attention-gym's document_causal does, in test_generate_attn_gym.py)
@pytest.mark.parametrize("name", sorted(set(SPECS) - {"prefix_const", "doc_flex"}))
def test_layout_generates_and_verifies(ingested_kb, tmp_path: Path, name: str) -> None:
    spec = tmp_path / f"{name}.py"
    spec.write_text(SPECS[name])
    r = generate(ingested_kb, spec, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, f"{name}: {r.error}"
    assert json.loads(r.files["report"].read_text())["verify"]["verdict"] == "passed"
    src = r.files["triton"].read_text()
    assert ("_block_class_kernel[" in src) is NEEDS_TABLE[name], "a table only where the classes are not closed-form"


# ------------------------------------------------------------------ the table: built on the GPU, once per mask

DOC_MASK = "(doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)"


def _doc_program():
    return forward("doc_s", mask_mod=DOC_MASK, aux=(Param("doc", ("N",), Dtype.I32, Role.AUX),), block_classes=True)


def _run(kernel: TritonKernel, doc: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = {n: torch.randn(2, 2, doc.shape[0], 16, generator=g) for n in "qkv"}
    out = kernel.run({**qkv, "doc": doc})
    o_ref, _ = reference_attention(kernel.program, qkv["q"], qkv["k"], qkv["v"], scalars={}, aux={"doc": doc})
    torch.testing.assert_close(out["o"], o_ref, atol=1e-4, rtol=1e-4)
    return out


def test_class_kernel_equals_dense_classes(tmp_path: Path) -> None:
    p = _doc_program()
    kernel = TritonKernel.from_program(p, tmp_path)
    doc = torch.tensor([0] * 11 + [1] * 30 + [2] * 12, dtype=torch.int32)
    q = torch.zeros(2, 2, doc.shape[0], 16)
    bc, _ = kernel.module.block_class_table(q, q, q, doc=doc)
    BM, BN = p.schedule.block_m, p.schedule.block_n
    env = {"N": doc.shape[0], "M": doc.shape[0]}
    padded = torch.nn.functional.pad(doc, (0, BN))  # the oracle also reads the padded tail (masked out of range)
    want = dense_block_classes(lambda q_idx, kv_idx: eval_expr(p.mask_mod.body, {**env, "q_idx": q_idx, "kv_idx": kv_idx},
                                                               {"doc": padded}), doc.shape[0], doc.shape[0], BM, BN)
    assert bc.shape == (1, 1, *want.shape) and torch.equal(bc[0, 0].long(), want)


def test_table_built_once_per_mask_and_rebuilt_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = TritonKernel.from_program(_doc_program(), tmp_path)
    builds: list[int] = []
    build = kernel.module._hblock_classes
    monkeypatch.setattr(kernel.module, "_hblock_classes", lambda *a: builds.append(1) or build(*a))
    doc = torch.tensor([0] * 20 + [1] * 13, dtype=torch.int32)
    _run(kernel, doc)
    _run(kernel, doc.clone(), seed=1)  # a new tensor with equal ids (another layer, another call)
    assert len(builds) == 1
    _run(kernel, torch.tensor([0] * 5 + [1] * 28, dtype=torch.int32))
    assert len(builds) == 2


def test_reverse_loop_over_a_table_runs_the_block_lists(tmp_path: Path) -> None:
    """A reference whose KV loop runs backwards (FA2's Triton kernel) visits only the listed partial and full
    blocks too, instead of branching on every block up to its bound (run 9: 0.66x FlexAttention)."""
    p = _doc_program()
    k = p.kernels[0]
    p = replace(p, kernels=(replace(k, body=tuple(replace(st, order="reverse") if isinstance(st, For) else st
                                                   for st in k.body)),))
    assert "KV loop over the host's block lists" in lower_program(p)
    _run(TritonKernel.from_program(p, tmp_path), torch.tensor([0] * 20 + [1] * 13 + [2] * 9, dtype=torch.int32))


def test_same_unmodified_ids_skip_the_content_compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One id tensor passed to every layer: compared (a device sync on a GPU) once, then known by identity and
    torch's version counter; an in-place change is seen and rebuilds the table."""
    kernel = TritonKernel.from_program(_doc_program(), tmp_path)
    monkeypatch.setattr(kernel.module, "_TABLES", {})  # the module is shared with the other tests of this program
    builds: list[int] = []
    build = kernel.module._hblock_classes
    monkeypatch.setattr(kernel.module, "_hblock_classes", lambda *a: builds.append(1) or build(*a))
    compares: list[int] = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compares.append(1) or equal(a, b))
    doc = torch.tensor([0] * 20 + [1] * 13, dtype=torch.int32)
    for seed in range(3):
        _run(kernel, doc, seed=seed)
    assert (len(builds), len(compares)) == (1, 0)
    doc[:25] = 0  # in place: a new mask in the same tensor
    _run(kernel, doc)
    assert len(builds) == 2


def test_invariant_mask_terms_load_once_before_the_kv_loop() -> None:
    src = lower_program(_doc_program())
    kernel = src[src.index("def _fwd_kernel("):src.index("def _block_class_kernel(")]
    loop = kernel.index("    for ")
    hoisted = "tl.load(doc_ptr + offs_m_start[:, None] * stride_doc_0"
    body = helper_source(src, "_fwd_kv_block")  # the KV loop's body, which its parts call
    assert hoisted in kernel[:loop] and hoisted not in kernel[loop:] and hoisted not in body
    assert "tl.load(doc_ptr + offs_n_start[None, :] * stride_doc_0" in body


# ------------------------------------------------------------------ closed form: no table


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_bounds_read_from_an_int64_prefix_compile_for_hopper(order: str) -> None:
    """The real Triton compiler (no GPU needed): KV loop bounds that load an int64 per-batch prefix stay 32-bit
    positions, as TMA descriptor loads need (run 9 found a kernel the interpreter ran but sm_90 refused)."""
    p = forward("prefix64", mask_mod="(kv_idx < prefix[b]) | (kv_idx <= q_idx)", dtype=Dtype.BF16,
                aux=(Param("prefix", ("B",), Dtype.I64, Role.AUX),), block_classes=True)
    k = p.kernels[0]
    body = tuple(replace(st, order=order) if isinstance(st, For) else st for st in k.body)
    p = Design(128, 64, 4, 3).apply(replace(p, kernels=(replace(k, body=body),)))
    (compiled,) = compile_for_arch(p, arch=90, head_dim=64, tma=True)
    assert compiled.tma_loads > 0


@pytest.mark.parametrize("mask, aux", [
    ("(kv_idx < 24) | (kv_idx <= q_idx)", {}),
    ("(kv_idx < prefix[b]) | (kv_idx <= q_idx)", {"prefix": torch.tensor([3, 40], dtype=torch.int32)}),
    ("(kv_idx < prefix[0]) | (kv_idx <= q_idx)", {"prefix": torch.tensor([17], dtype=torch.int32)}),
])
def test_prefix_masks_are_closed_form(mask: str, aux: dict, tmp_path: Path) -> None:
    params = tuple(Param(n, ("B",) if "[b]" in mask else (1,), Dtype.I32, Role.AUX) for n in aux)
    p = forward("prefix", mask_mod=mask, aux=params, block_classes=True)
    assert plan_block_mask(p).kind is BlockMaskKind.ANALYTIC
    src = lower_program(p)
    assert "bc_ptr" not in src and "_block_class_kernel" not in src
    assert "# full blocks" in src or "full blocks" in src  # the split loop runs full blocks without mask code
    g = torch.Generator().manual_seed(0)
    qkv = {n: torch.randn(2, 2, 45, 16, generator=g) for n in "qkv"}
    out = TritonKernel.from_program(p, tmp_path).run({**qkv, **aux})
    o_ref, lse_ref = reference_attention(p, qkv["q"], qkv["k"], qkv["v"], scalars={}, aux=aux)
    torch.testing.assert_close(out["o"], o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["lse"], lse_ref, atol=1e-4, rtol=1e-4)


def test_offsets_become_ids_the_candidate_derives(tmp_path: Path) -> None:
    spec = tmp_path / "offsets.py"
    spec.write_text(SPECS["doc_offsets"])
    s = load_spec(spec)
    assert s.derived_aux == {"offsets_right_ids": ("offsets", True)}
    assert s.features.mask == "document"  # (ids - 1) == (ids - 1) reads as a document mask
    want = torch.searchsorted(torch.tensor([0, 37, 81, 100], dtype=torch.int32), torch.arange(100, dtype=torch.int32),
                              right=True)
    assert torch.equal(s.aux["offsets_right_ids"], want)


def test_other_searchsorted_is_refused_by_name(tmp_path: Path) -> None:
    spec = tmp_path / "offsets.py"
    spec.write_text(SPECS["doc_offsets"].replace("torch.arange(q.shape[2], dtype=torch.int32)",
                                                 "2 * torch.arange(q.shape[2], dtype=torch.int32)"))
    with pytest.raises(KBError, match="torch.searchsorted") as err:
        load_spec(spec)
    assert "\n" not in str(err.value)
