"""Serving specs generate: a paged-KV decode spec gets a lifted vLLM/SGLang decode program with its variant slots
filled, checked in the interpreter on the spec's own paged inputs, lowered to Triton and verified as a ModelNew that
takes the engine's tensors as they are (issue 32)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # ModelNew runs in this process; set before triton is imported

import pytest
import torch

from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec
from generate.target import target_for
from generate.transfer_serving import transfer_serving
from kb.ir.expr import const, parse_expr
from kb.ir.nodes import Init, Let, Mask, ScoreMod, walk_stmts
from kb.ir.validate import problems
from kb.ir.text import parse_program, print_program
from kb.lower.runtime import import_file
from tests.support.generate_fixtures import QUICK
from tests.support.ir_programs import SERVING_TEXTS
from tests.support.repo import REPO

SERVING = REPO / "tests" / "data" / "specs_serving"
SOFTCAP_WINDOW = SERVING / "paged_decode_softcap_window.py"
GQA_ALIBI = SERVING / "paged_gqa_decode_alibi_odd.py"  # reads the head: each row of a grouped tile its own


def test_transfer_names_the_specs_tables_and_places_the_variant() -> None:
    spec = load_spec(SOFTCAP_WINDOW)
    assert spec.layout is not None and (spec.layout.table, spec.layout.lengths) == ("block_table", "seq_lens")
    ref = parse_program(SERVING_TEXTS["pool_decode"].replace("req_to_token", "req_to_tokens"))
    p = transfer_serving(ref, spec.layout, target_for(spec), name="t")
    params = {q.name: q for q in p.params}
    assert "block_table" in params and "seq_lens" in params and "req_to_tokens" not in params
    text = "\n".join(str(st) for st in p.kernels[0].body)
    assert "ScoreMod" in text
    assert p.score_mod is not None and "tanh" in str(p.score_mod.body)
    # the 40-key window: each split's loop starts at the KV block of the first key the query sees, not at key 0
    printed = print_program(p)
    assert "let kv_first = seq_lens[b] - 41 + 1" in printed
    assert "for n_start in range(maximum(0, kv_first // BLOCK_N * BLOCK_N), kv_len, BLOCK_N)" in printed


def test_a_grouped_reference_gives_each_tile_row_its_own_head() -> None:
    spec = load_spec(SOFTCAP_WINDOW)
    grouped = parse_program(SERVING_TEXTS["pool_decode"]
                            .replace("load qt = q[b, h:+1, :]", "load qt = q[b, h:+BLOCK_M, :]"))
    target = replace(target_for(spec), score_mod=parse_expr("score + h"))
    p = transfer_serving(grouped, spec.layout, target, name="t")
    placed = [st for st in walk_stmts(p.kernels[0].body) if isinstance(st, (ScoreMod, Mask))]
    assert placed and all(st.at.head_rows and st.at.q_start == const(0) for st in placed)
    assert "at (b, heads h, 0, " in print_program(p)  # row i of the tile is head h + i
    # sinks: each row starts at its own head's sink logit (rows past the group at -inf)
    sinks = load_spec(SERVING / "pool_decode_sinks.py")
    printed = print_program(transfer_serving(grouped, sinks.layout, target_for(sinks), sinks=sinks.sinks, name="t"))
    assert "load sink_rows = sinks[h:+BLOCK_M] other -inf" in printed, printed
    assert "elementwise m_i = sink_rows" in printed and "init l_i = full(1; 1.0) f32" in printed


@pytest.mark.network  # the session KB ingests the real vLLM and SGLang releases
@pytest.mark.parametrize("path", [SOFTCAP_WINDOW, SERVING / "pool_decode_sinks.py", GQA_ALIBI,
                                  SERVING / "varlen_prefix_causal.py", SERVING / "chunked_prefill_causal_softcap.py"],
                         ids=lambda p: p.stem)
def test_decode_spec_generates_a_verified_kernel_over_the_engines_tensors(ingested_kb, tmp_path: Path,
                                                                          path: Path) -> None:
    r = generate(ingested_kb, path, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, r.error + "\n" + "\n".join(f"{a.strategy}/{a.stage.value}: {a.verdict} {a.feedback[:300]}"
                                                   for a in r.attempts)
    report = json.loads(r.files["report"].read_text())
    assert report["verify"]["verdict"] == "passed"
    assert "forward only" in report["backward"]["reason"]
    ref = ingested_kb.get(ingested_kb.get(r.kernel_id).parent_id)
    assert ref.family in ("vllm_triton", "sglang_triton")
    if path in (GQA_ALIBI, SERVING / "pool_decode_sinks.py"):  # K/V read once per GQA group; ALiBi, sinks per row
        assert "grouped" in ref.name, ref.name
    if path.stem.startswith("varlen"):  # inside sequence b's program, a token's sequence id is b + 1: no id tables
        program = ingested_kb.get(r.kernel_id).ir_text
        assert not set(load_spec(path).derived_aux) & set(re.findall(r"\w+", program))
        layout = load_spec(path).layout
        assert f"kv_idx < {layout.table_k or layout.table}[b + 1]" in program and "b == b" not in program
    # the user's call: the spec's own inputs, the cache as it is, the Model's state, output in q's dtype
    spec_mod = import_file(path, f"spec_{path.stem}")
    cand = import_file(r.files["candidate"], f"cand_{path.stem}")
    inputs = spec_mod.get_inputs()
    model, new = spec_mod.Model(), cand.ModelNew()
    new.load_state_dict(model.state_dict())
    with torch.no_grad():
        want, got = model(*inputs), new(*inputs)
    assert got.dtype == inputs[0].dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_reference_generated_for_a_window_transfers_onto_a_window_again() -> None:
    # the KB holds what it generated: a window + sinks decode, whose loop starts at its window, is the nearest
    # reference for the next windowed spec; its old window start goes, the new one is placed once
    spec = load_spec(REPO / "bench" / "heldout_serving" / "paged_decode_window_sinks.py")
    once = transfer_serving(parse_program(SERVING_TEXTS["paged_decode"]), spec.layout, target_for(spec),
                            sinks=spec.sinks, name="t")
    twice = transfer_serving(once, spec.layout, target_for(spec), sinks=spec.sinks, name="t")
    assert problems(twice) == ()
    split = twice.kernels[0]
    (first,) = [st for st in split.body if isinstance(st, Let) and st.name.startswith("kv_first")]
    assert first.value == next(st.value for st in once.kernels[0].body if isinstance(st, Let) and st.name == "kv_first")


def test_a_narrow_window_keeps_each_split_at_least_four_kv_blocks() -> None:
    ref = parse_program(SERVING_TEXTS["paged_decode"])
    ref = replace(ref, schedule=replace(ref.schedule, block_n=32, num_splits=3))
    spec = load_spec(REPO / "bench" / "heldout_serving" / "paged_decode_window_sinks.py")
    target = target_for(spec)

    def splits(mask: str | None) -> int:
        t = replace(target, mask_mod=parse_expr(mask) if mask else target.mask_mod)
        return transfer_serving(ref, spec.layout, t, sinks=spec.sinks, name="t").schedule.num_splits

    assert splits(None) == 1  # 128 keys: 5 blocks of 32 (an unaligned start adds one), too few for a second split
    assert splits("(kv_idx <= seq_lens[b] - 1) & (kv_idx > seq_lens[b] - 513)") == 3  # 512 keys: 17 blocks
    assert splits("(kv_idx <= seq_lens[b] - 1) & (kv_idx > seq_lens[b] - 225)") == 2  # 224 keys: 8 blocks
    assert splits("kv_idx <= seq_lens[b] - 1") == 3  # no window: the reference's own count
    assert splits("(kv_idx <= seq_lens[b] - 1) & (kv_idx > seq_lens[b] // 2)") == 3  # a window that grows with the context


def test_sinks_start_the_softmax_and_a_sinks_reference_serves_a_spec_without() -> None:
    spec = load_spec(SERVING / "pool_decode_sinks.py")
    p = transfer_serving(parse_program(SERVING_TEXTS["pool_decode"]), spec.layout, target_for(spec), sinks=spec.sinks,
                         name="t")
    inits = {st.out: st.fill for st in p.kernels[0].body if isinstance(st, Init)}
    assert inits["m_i"] == parse_expr("sinks[h]") and inits["l_i"] == 1.0
    plain = load_spec(SOFTCAP_WINDOW)
    again = transfer_serving(parse_program(SERVING_TEXTS["paged_decode_sinks"]), plain.layout, target_for(plain), name="t")
    inits = {st.out: st.fill for st in again.kernels[0].body if isinstance(st, Init)}
    assert inits["m_i"] == float("-inf") and inits["l_i"] == 0.0 and "sinks" not in {q.name for q in again.params}
