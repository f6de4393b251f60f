"""The fusions the Triton generator spells are planned from the IR before it writes a line."""

from __future__ import annotations

from dataclasses import replace

from kb.ir.nodes import Dtype, Init, walk_stmts
from kb.lower.triton_fusion import plan_fusions
from tests.support.ir_programs import causal_bwd, forward


def test_the_forward_scale_folds_into_the_exponent_only_when_asked() -> None:
    k = forward("fold", mask_mod="kv_idx <= q_idx").kernels[0]
    assert list(plan_fusions(k, {"sm_scale"}, fold_scale=True, accumulate=False).folds.values()) == ["sm_scale"]
    assert not plan_fusions(k, {"sm_scale"}, fold_scale=False, accumulate=False).folds
    assert not plan_fusions(k, set(), fold_scale=True, accumulate=False).folds  # sm_scale is no float scalar here


def test_backward_dots_accumulate_into_f32_accumulators_only() -> None:
    dkdv = next(k for k in causal_bwd().kernels if k.name == "bwd_dkdv")
    accs = set(plan_fusions(dkdv, {"sm_scale"}, fold_scale=False, accumulate=True).accumulates.values())
    assert accs == {"dv_acc", "dk_acc"}
    # the same kernel with bf16 accumulators: a dot's fp32 result is not added into them inside the dot
    bf16 = replace(dkdv, body=tuple(replace(st, dtype=Dtype.BF16) if isinstance(st, Init) and st.out in accs else st
                                    for st in dkdv.body))
    assert not plan_fusions(bf16, {"sm_scale"}, fold_scale=False, accumulate=True).accumulates
    assert any(isinstance(st, Init) for st in walk_stmts(bf16.body))
