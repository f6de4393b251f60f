"""Serving layouts lowered to Triton: varlen prefill (`until` spans over token-major q/k/v/o), vLLM paged decode (a
page-table load as a scalar index into a 4-D cache, one-row `h:+1` tiles) and SGLang token-pool decode (a gathered
axis) run under the Triton interpreter and match the IR interpreter (o and lse) and the per-sequence torch reference
(o): ragged lengths (0 where the layout allows it, 1, not a multiple of the block), pages and pool rows in random
order (never shared), GQA (Hq=4, Hkv=2), a head dim that is not a power of two (12), f32 and bf16 inputs.
"""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import re
from pathlib import Path

import pytest
import torch

from kb.errors import KBError
from kb.ir.evaluate import paged_to_token_major, pool_to_token_major, varlen_attention
from kb.ir.interpret import interpret
from kb.ir.nodes import Program
from kb.ir.text import parse_program
from kb.lower.cuda import lower_program as lower_cuda
from kb.lower.runtime import TritonKernel
from kb.ir.design import parse_design
from kb.lower.serving import free_tiles, key_capacity, layout_scalars, split_kv_blocks
from kb.lower.triton import lower_program
from kb.lower.triton_aot import compile_for_arch
from tests.support.ir_programs import SERVING_TEXTS

GOLDEN = Path(__file__).parent / "golden" / "triton"
UPDATE_GOLDEN = os.environ.get("KB_UPDATE_GOLDEN") == "1"  # read at import: conftest clears KB_* per test
HQ, HKV, D = 4, 2, 12  # GQA 2:1, a head dim that is not a power of two
SCALE = 0.3
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SERVING = ("varlen_prefill", "paged_decode", "pool_decode")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton_cache")


def _program(name: str, dtype: torch.dtype = torch.float32) -> Program:
    """The fixture, its q, k, v, o declared in `dtype` (lse stays f32)."""
    text = SERVING_TEXTS[name]
    if dtype is torch.bfloat16:
        text = re.sub(r"^(param [qkvo]: \[[^\]]*\]) f32", r"\1 bf16", text, flags=re.M)
    return parse_program(text)


def _cumsum(lens: list[int]) -> list[int]:
    return [sum(lens[:i]) for i in range(len(lens))]


def _run_and_compare(name: str, dtype: torch.dtype, inputs: dict, reference_o: torch.Tensor | None, cache_dir: Path,
                     program: Program | None = None) -> dict:
    """Run the lowered module on `inputs` (q, k, v in `dtype`) and compare with the interpreter on the same values in
    fp32 (o and lse, -inf exactly where it is) and with the torch reference (o)."""
    p = program or _program(name)
    wide = {n: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in inputs.items()}
    want = interpret(p, wide).outputs
    got = TritonKernel.from_program(program or _program(name, dtype), cache_dir).run(inputs)
    assert got["o"].dtype == dtype and got["lse"].dtype == torch.float32  # o in the inputs' dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got["o"].float(), want["o"], atol=tol, rtol=tol)
    torch.testing.assert_close(got["lse"], want["lse"], atol=tol, rtol=tol)
    if reference_o is not None:
        torch.testing.assert_close(got["o"].float(), reference_o, atol=tol, rtol=tol)
    return got


def _decode_reference(q: torch.Tensor, k_tm: torch.Tensor, v_tm: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
    B = len(kv_lens)
    return varlen_attention(q.float(), k_tm.float(), v_tm.float(), list(range(B)), [1] * B, _cumsum(kv_lens), kv_lens,
                            sm_scale=SCALE, causal=True)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_prefill(dtype: torch.dtype, cache_dir: Path) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [1, 13, 16, 21, 0]  # one token, ragged against BLOCK_M=16 / BLOCK_N=8, one block exactly, empty
    # the sequences lie in memory in reverse batch order: a tile stored past its sequence's end (no `until`) would
    # overwrite the rows of a sequence whose programs ran before it
    T, starts = sum(lens), [sum(lens[b + 1:]) for b in range(len(lens))]
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    inputs = {"q": q, "k": k, "v": v, "b_start_loc": torch.tensor(starts, dtype=torch.int32),
              "b_seq_len": torch.tensor(lens, dtype=torch.int32), "sm_scale": SCALE, "max_seq_len": max(lens)}
    o, _ = varlen_attention(q.float(), k.float(), v.float(), starts, lens, starts, lens, sm_scale=SCALE, causal=True)
    _run_and_compare("varlen_prefill", dtype, inputs, o, cache_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_runs_interior_blocks_without_mask_code(dtype: torch.dtype, cache_dir: Path) -> None:
    """Packed sequences at global token positions (flash_attn_varlen's form, as the serving transfer writes it): the
    KV loop splits into partial / full / partial blocks per sequence from the mask's two bounds, and the result is
    the interpreter's, for queries that are a suffix of their keys (bottom-right causal), ragged against 16x16 tiles,
    one-token and empty sequences, and sequences long enough for full blocks."""
    p = _program("packed_prefill", dtype)
    src = lower_program(p)
    assert "# full blocks" in src and "IS_FULL=True" in src
    g = torch.Generator().manual_seed(3)
    q_lens, k_lens = [37, 0, 1, 50, 16], [37, 5, 1, 81, 40]
    cu_q, cu_k = ([0, *torch.tensor(x).cumsum(0).tolist()] for x in (q_lens, k_lens))
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(sum(k_lens), HKV, D, generator=g).to(dtype) for _ in range(2))
    inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
              "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32), "sm_scale": SCALE, "max_seq_len": max(q_lens)}
    o, _ = varlen_attention(q.float(), k.float(), v.float(), cu_q[:-1], q_lens, cu_k[:-1], k_lens, sm_scale=SCALE, causal=True)
    _run_and_compare("packed_prefill", dtype, inputs, o, cache_dir)


def test_packed_prefill_softcap_compiles_for_hopper_with_one_mufu_tanh() -> None:
    """Triton's compiler (bundled ptxas) builds the split packed prefill with a softcap for sm_90 at a bench design,
    using wgmma and TMA copies (descriptors over each head's packed rows, the sequence's end as their extent), and
    the softcap's tanh is PTX tanh.approx.f32 (the interpreter, which runs no PTX, takes the exact 2*sigmoid(2x)-1
    and the masked loads: the CPU tests above)."""
    text = SERVING_TEXTS["packed_prefill"].replace("mask_mod(b, h", "score_mod(score, b, h, q_idx, kv_idx) = "
                                                   "tanh(score / 50.0) * 50.0\nmask_mod(b, h", 1)
    text = text.replace("    mask qk at", "    score_mod qk at (b, h, q0 + m_start, k0 + n_start)\n    mask qk at", 1)
    p = parse_design("128x64 w8 s3").apply(parse_program(re.sub(r"^(param [qkvo]: \[[^\]]*\]) f32", r"\1 bf16", text,
                                                                flags=re.M)))
    src = lower_program(p)
    assert "IS_FULL=True" in src
    assert "_desc_k = tl.make_tensor_descriptor(k_ptr + hk * stride_k_1, shape=[tl.maximum(tl.minimum(k0 + k_len, N), 1)" in src
    assert "_desc_o" not in src  # o's rows past a sequence's end are never written: its store stays masked
    (k,) = compile_for_arch(p, arch=90, head_dim=128, tma=True)
    assert k.wgmma > 0 and k.tanh_approx > 0 and k.tma_loads > 0


def _paged_cache(g: torch.Generator, kv_lens: list[int], page: int, max_pages: int, dtype: torch.dtype):
    """k, v caches [NUM_PAGES, page, HKV, D] (3 pages unused) and a block table listing each sequence's pages once, in
    random order; entries past a sequence's last page hold a page number past the cache (never read)."""
    pages = [-(-n // page) for n in kv_lens]
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(kv_lens), max_pages), num_pages + 100, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    k, v = (torch.randn(num_pages, page, HKV, D, generator=g).to(dtype) for _ in range(2))
    return k, v, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_gqa(dtype: torch.dtype, cache_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)
    kv_lens = [1, 0, 8, 13, 30]  # one key, none (o = 0, lse = -inf), one page exactly, ragged last pages
    k, v, table = _paged_cache(g, kv_lens, page=8, max_pages=5, dtype=dtype)
    q = torch.randn(len(kv_lens), HQ, D, generator=g).to(dtype)
    inputs = {"q": q, "k": k, "v": v, "block_table": table, "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
              "sm_scale": SCALE}
    k_tm, _ = paged_to_token_major(k, table, kv_lens)
    v_tm, _ = paged_to_token_major(v, table, kv_lens)
    got = _run_and_compare("paged_decode", dtype, inputs, _decode_reference(q, k_tm, v_tm, kv_lens), cache_dir)
    assert bool((got["o"][1] == 0).all()) and bool(torch.isneginf(got["lse"][1]).all())


def test_paged_decode_with_sinks(cache_dir: Path) -> None:
    g = torch.Generator().manual_seed(2)
    kv_lens = [0, 5, 13]  # an empty sequence: the sink takes all the weight, o = 0 and lse = sink
    k, v, table = _paged_cache(g, kv_lens, page=8, max_pages=2, dtype=torch.float32)
    q, sinks = torch.randn(len(kv_lens), HQ, D, generator=g), torch.linspace(-2.0, 3.0, HQ)
    inputs = {"q": q, "k": k, "v": v, "block_table": table, "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
              "sinks": sinks, "sm_scale": SCALE}
    got = _run_and_compare("paged_decode_sinks", torch.float32, inputs, None, cache_dir)
    assert bool((got["o"][0] == 0).all()) and torch.equal(got["lse"][0], sinks)


def test_page_numbers_out_of_range_read_zeros(cache_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    kv_lens = [13, 20]
    k, v, table = _paged_cache(g, kv_lens, page=8, max_pages=3, dtype=torch.float32)
    table[0, 1], table[1, 0] = -1, k.shape[0] + 7  # the IR reads `other` (0) for keys of a page past the cache
    inputs = {"q": torch.randn(len(kv_lens), HQ, D, generator=g), "k": k, "v": v, "block_table": table,
              "seq_lens": torch.tensor(kv_lens, dtype=torch.int32), "sm_scale": SCALE}
    _run_and_compare("paged_decode", torch.float32, inputs, None, cache_dir)


def _pool_inputs(g: torch.Generator, kv_lens: list[int], dtype: torch.dtype) -> dict:
    """k, v token pools [POOL, HKV, D] (5 rows unused) and req_to_token [B, max(kv_lens)] naming each sequence's rows
    once, in random order; entries past a sequence's length hold a row past the pool (never read)."""
    pool = sum(kv_lens) + 5
    rows = torch.randperm(pool, generator=g)
    req_to_token = torch.full((len(kv_lens), max(kv_lens)), pool + 100, dtype=torch.int32)
    for b, start in enumerate(_cumsum(kv_lens)):
        req_to_token[b, :kv_lens[b]] = rows[start:start + kv_lens[b]]
    k, v = (torch.randn(pool, HKV, D, generator=g).to(dtype) for _ in range(2))
    return {"q": torch.randn(len(kv_lens), HQ, D, generator=g).to(dtype), "k": k, "v": v, "req_to_token": req_to_token,
            "seq_lens": torch.tensor(kv_lens, dtype=torch.int32), "sm_scale": SCALE}


def test_invalid_gathered_lanes_read_other(cache_dir: Path) -> None:
    # without the mask_mod only the gather's `valid` keeps a lane past the sequence out: it reads k = v = 0 (score 0)
    p = parse_program(SERVING_TEXTS["pool_decode"].replace("    mask s at (b, h, kv_len - 1, n_start) mask_mod\n", ""))
    inputs = _pool_inputs(torch.Generator().manual_seed(5), [3, 13], torch.float32)
    _run_and_compare("pool_decode", torch.float32, inputs, None, cache_dir, program=p)


@pytest.mark.parametrize("old, new", [
    (" if n_start + j < kv_len]", " if n_start < kv_len]"),  # a validity that is the same for every lane
    ("req_to_token[b, n_start + j] for j", "req_to_token[b, n_start] for j"),  # one row for every lane
])
def test_gathers_that_do_not_move_with_the_lane(old: str, new: str, cache_dir: Path) -> None:
    p = parse_program(SERVING_TEXTS["pool_decode"].replace(old, new))
    inputs = _pool_inputs(torch.Generator().manual_seed(6), [3, 13], torch.float32)
    inputs["req_to_token"] = torch.nn.functional.pad(inputs["req_to_token"], (0, 3))  # every lane of a block in range
    _run_and_compare("pool_decode", torch.float32, inputs, None, cache_dir, program=p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_decode(dtype: torch.dtype, cache_dir: Path) -> None:
    kv_lens = [1, 0, 13, 30, 8]  # MAX_CTX = 30: the last block's lanes past it read no table entry
    inputs = _pool_inputs(torch.Generator().manual_seed(2), kv_lens, dtype)
    q, k, v, req_to_token = (inputs[n] for n in ("q", "k", "v", "req_to_token"))
    k_tm, _ = pool_to_token_major(k, req_to_token, kv_lens)
    v_tm, _ = pool_to_token_major(v, req_to_token, kv_lens)
    want_o = _decode_reference(q, k_tm, v_tm, kv_lens)
    got = _run_and_compare("pool_decode", dtype, inputs, want_o, cache_dir)
    if dtype is torch.float32:  # the operator takes the engine's tensors in program order (q, k, v, aux, sm_scale)
        mod = TritonKernel.from_program(_program("pool_decode"), cache_dir).module
        o, lse = getattr(torch.ops.kernel_kb, mod.OP_NAME + "_infer")(q, k, v, req_to_token, inputs["seq_lens"], SCALE)
        assert torch.equal(o, got["o"]) and torch.equal(lse, got["lse"])
        kw = {n: inputs[n] for n in ("req_to_token", "seq_lens")}
        assert torch.equal(mod.kb_attention(q, k, v, sm_scale=SCALE, **kw), got["o"])


@pytest.mark.parametrize("name", SERVING)
def test_golden_source(name: str) -> None:
    src = lower_program(_program(name))
    path = GOLDEN / f"serving_{name}.py"
    if UPDATE_GOLDEN:
        path.write_text(src)
    assert path.exists(), f"missing golden file {path}; run with KB_UPDATE_GOLDEN=1"
    assert src == path.read_text(), f"generated source for {name} changed; review and run with KB_UPDATE_GOLDEN=1"


def test_generated_code_shape() -> None:
    varlen, paged, pool = (lower_program(_program(n)) for n in SERVING)
    assert "(offs_r[:, None] < (q0 + q_len))" in varlen  # `until` joins the extent tests of q's rows
    assert "tl.dot(" not in paged.split("PROGRAM = ")[0]  # one query row: broadcast multiply-sums, no tl.dot
    assert "tl.dot(" not in varlen.split("PROGRAM = ")[0]  # nor K = BLOCK_N = 8 (GPUs want K >= 16 for 16-bit)
    assert "page.to(tl.int64) * stride_k_0" in paged and "tl.load(block_table_ptr" in paged  # the page-table load indexes k
    assert "tl.where(_lane_ok, (n_start + offs_r), 0)" in pool  # an invalid lane's table index is clamped
    assert pool.count("_rows = (tl.load(req_to_token_ptr") == 1  # K and V share one table lookup
    assert "DESIGNS = {}" in pool and "PROGRAM_DESIGN = (16, 8, 1, 4, 1, False, False)" in pool


def test_only_integer_divisors_of_an_index_are_compiled_in() -> None:
    # the fixtures' pages are BLOCK_N long and max_seq_len sizes a grid: no scalar becomes a constexpr
    assert [layout_scalars(_program(n)) for n in SERVING] == [(), (), ()]
    text = SERVING_TEXTS["pool_decode"].replace("param sm_scale: [] f32 scalar",
                                                "param sm_scale: [] f32 scalar\nparam ROWS: [] i32 scalar")
    text = re.sub(r"req_to_token\[b, ([^\]]*)\]", r"req_to_token[b, (\1) // ROWS] + (\1) % ROWS", text)
    assert "// ROWS]" in text
    p = parse_program(text)
    assert layout_scalars(p) == ("ROWS",)
    src = lower_program(p)
    assert "    ROWS: tl.constexpr," in src and "ROWS=ROWS" in src


def test_block_class_tests_are_refused_with_the_reason() -> None:
    loop = "  for n_start in range(0, kv_len, BLOCK_N) forward:\n"
    text = SERVING_TEXTS["paged_decode"]
    body = text[text.index(loop) + len(loop):text.index("  finalize")]
    text = text.replace(loop + body, loop + "    if block(b, h, kv_len - 1, n_start) is not empty:\n"
                        + "".join(f"  {line}\n" for line in body.splitlines()))
    with pytest.raises(KBError, match="Triton lowering of varlen/paged programs does not support block-class tests"):
        lower_program(parse_program(text))


def test_cuda_lowering_still_refuses_serving_layouts() -> None:
    for name in SERVING:
        with pytest.raises(KBError, match=r"not supported yet|must be \[B, H, S, D\]"):
            lower_cuda(_program(name))


def test_rows_whose_element_offset_passes_int32(cache_dir: Path) -> None:
    # a KV cache of millions of token rows: row * row stride passes 2**31 elements (256 x 32K tokens x 8 heads x 64 on
    # a GPU; here a few rows of a pool whose row stride is 2**23 elements, in storage the OS never backs, as only the
    # rows written and read are touched)
    stride, pool = 1 << 23, 300
    storage = torch.empty(pool * stride, dtype=torch.bfloat16)
    inputs = _pool_inputs(torch.Generator().manual_seed(7), [3, 13], torch.bfloat16)
    rows = torch.tensor([5, 290, 260, 299, 256, 257, 258, 259, 261, 262, 263, 264, 265, 266, 267, 1], dtype=torch.int32)
    inputs["req_to_token"] = rows[:13].repeat(2, 1)
    for name in ("k", "v"):
        big = storage.as_strided((pool, HKV, D), (stride, D, 1), storage_offset=0 if name == "k" else HKV * D)
        big[rows.long()] = torch.randn(len(rows), HKV, D, generator=torch.Generator().manual_seed(8)).to(big.dtype)
        inputs[name] = big
    k_tm, _ = pool_to_token_major(inputs["k"], inputs["req_to_token"], [3, 13])
    v_tm, _ = pool_to_token_major(inputs["v"], inputs["req_to_token"], [3, 13])
    got = TritonKernel.from_program(_program("pool_decode", torch.bfloat16), cache_dir).run(inputs)
    torch.testing.assert_close(got["o"].float(), _decode_reference(inputs["q"], k_tm, v_tm, [3, 13]), atol=2e-2, rtol=2e-2)


def test_a_program_whose_lanes_find_their_own_pages_runs_the_designs_generation_chose() -> None:
    pool, paged = _program("pool_decode"), _program("paged_decode")
    # the token pool gathers a row per lane; the paged fixture's tile is one page (`n_start // BLOCK_N`)
    assert free_tiles(pool) and not free_tiles(paged)
    assert key_capacity(pool) == "MAX_CTX" and key_capacity(paged) == "MAX_PAGES * PAGE"
    table = {"sm90": {16: [parse_design("16x64 w4 s3")]}}
    pool = dataclasses.replace(pool, schedule=dataclasses.replace(pool.schedule, block_n=16))
    assert "DESIGNS = {}" in lower_program(_program("pool_decode"), designs=table)  # BLOCK_N 8 is no design
    src = lower_program(pool, designs=table)
    assert "DESIGNS = {'sm90': {16: [(16, 64, 1, 4, 3, True, False)]}}" in src and "_choose_design(" in src
    own = lower_program(paged, designs=table)  # another tile would read another page: its own schedule only
    assert "DESIGNS = {}" in own and "_own_design(" in own


def test_the_split_rule_divides_a_windows_blocks_not_the_whole_table() -> None:
    """A listed design's split count is chosen at launch: over a window's cdiv(W, BLOCK_N) + 1 blocks when the mask
    bounds the keys to W below the length (as the transfer caps the program's own schedule), else over the table."""
    text = SERVING_TEXTS["pool_decode"]
    windowed = parse_program(text.replace("mask_mod(b, h, q_idx, kv_idx) = kv_idx < seq_lens[b]",
                                          "mask_mod(b, h, q_idx, kv_idx) = (kv_idx < seq_lens[b]) & (kv_idx > seq_lens[b] - 33)"))
    assert split_kv_blocks(windowed) == "_hcdiv(32, BLOCK_N) + 1"
    assert split_kv_blocks(parse_program(text)) == "_hcdiv(MAX_CTX, BLOCK_N)"
