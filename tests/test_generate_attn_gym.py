"""attention-gym's published masks and mods (attn-gym==0.0.17, a dev dependency) as FlexAttention-style specs
(bench/heldout_attn_gym/, one file per factory): which trace, and why the others are refused.

Every spec FlexAttention itself runs must trace; its reference must equal FlexAttention's own output, and a
program transferred from a hermetic fixture with its variants must pass the IR check in the interpreter and
lower to Triton and CUDA. `EXPECTED` pins which trace and which are refused (a regression either way shows).
Two representative ones generate and verify end to end (the rest: bench/attn_gym_run.py, docs/attn_gym.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from generate.attempts import check_program
from generate.pipeline import GenerateOptions, generate
from generate.spec import Spec, import_spec_file, load_spec, spec_inputs
from generate.target import target_for
from generate.transfer import Strategy, transfer
from kb.errors import KBError
from kb.ir.validate import validate
from kb.lower.cuda import lower_program as lower_cuda
from kb.lower.triton import lower_program as lower_triton
from tests.support import ir_programs
from tests.support.generate_fixtures import QUICK
from tests.support.repo import REPO
from verify.load import load_spec as load_verify_spec
from verify.result import ShapeCase
from verify.shapes import plan_cases

pytest.importorskip("attn_gym")

SPECS = REPO / "bench" / "heldout_attn_gym"

# spec -> None (traces) or the refusal's text. The data-bound column: the dims the data its mods read fixes.
EXPECTED: dict[str, tuple[str | None, frozenset[str]]] = {
    "activation_gelu": (None, frozenset()),
    "activation_relu": (None, frozenset()),
    "alibi": (None, frozenset()),
    "batchify": (None, frozenset()),
    "block_diffusion": (None, frozenset()),
    "causal": (None, frozenset()),
    "dilated_sliding_window": (None, frozenset()),
    "document_bidirectional": (None, frozenset("MN")),
    "document_causal": (None, frozenset("MN")),
    "flamingo_cross": (None, frozenset("N")),
    "global_sliding_window": (None, frozenset("MN")),
    "graphormer_edge": (None, frozenset({"B", "Hq", "M", "N"})),
    "graphormer_spatial": (None, frozenset({"B", "Hq", "M", "N"})),
    "jetspec_training": (None, frozenset()),
    "jetspec_tree": (None, frozenset("M")),
    "mla_rope": (None, frozenset({"B", "Hq", "M", "N"})),
    "morton_natten": (None, frozenset()),
    "natten": (None, frozenset()),
    "packed_causal_document": (None, frozenset("M")),
    "prefix_lm": (None, frozenset()),
    "sandwich": (None, frozenset({"Hq"})),
    "shared_prefix": (None, frozenset("M")),
    "sliding_window": (None, frozenset()),
    "softcap": (None, frozenset()),
    "softcap_approx": (None, frozenset()),
    "sta_2d": (None, frozenset()),
    "sta_3d": (None, frozenset()),
    "svg_spatial": (None, frozenset()),
    "svg_temporal": (None, frozenset()),
    "tiled_natten": (None, frozenset()),
    "vsa": (None, frozenset({"B", "Hq", "M"})),
    "vsa_padded": (None, frozenset({"B", "Hq", "M", "N"})),
}


def test_every_spec_file_is_in_the_table() -> None:
    assert sorted(p.stem for p in SPECS.glob("*.py")) == sorted(EXPECTED)


def _flex_output(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FlexAttention itself (eager, CPU) on the spec file's own mods."""
    module = import_spec_file(spec.path)
    s = spec.shapes
    mask_mod, score_mod = getattr(module, "mask_mod", None), getattr(module, "score_mod", None)
    block_mask = create_block_mask(mask_mod, s.B, s.Hq, s.M, s.N, device="cpu") if mask_mod else None
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=spec.softmax_scale,
                          enable_gqa=s.Hq != s.Hkv)


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_spec_traces_or_is_refused(stem: str) -> None:
    refusal, _ = EXPECTED[stem]
    path = SPECS / f"{stem}.py"
    if refusal is not None:
        with pytest.raises(KBError, match=refusal) as err:
            load_spec(path)
        assert "\n" not in str(err.value)
        return
    spec = load_spec(path)
    q, k, v = (x.float() for x in spec_inputs(spec, seed=3))
    with torch.no_grad():
        ref, flex = spec.reference(q, k, v), _flex_output(spec, q, k, v)
    assert (ref - flex).abs().max().item() < 1e-4, f"{stem}: the spec's reference is not FlexAttention's output"
    target = target_for(spec)
    program = transfer(ir_programs.causal(target.dtype), target, Strategy.BLOCK_MASK, name=stem)
    program = replace(program, schedule=replace(program.schedule, block_m=64, block_n=64))  # fewer interpreted tiles
    validate(program)
    assert check_program(program, spec) is None
    lower_triton(program)
    lower_cuda(program)


@pytest.mark.parametrize("stem", sorted(s for s, (refusal, _) in EXPECTED.items() if refusal is None))
def test_data_bound_dims(stem: str) -> None:
    """The dims a spec's data fixes are found, and shape planning keeps them at the spec's own values."""
    _, fixed = EXPECTED[stem]
    vspec = load_verify_spec(SPECS / f"{stem}.py")
    assert set(vspec.fixed_dims) == fixed
    cases, notes = plan_cases(vspec, vspec.get_inputs(), max_cases=12)
    own = cases[0]
    field = {"B": "B", "Hq": "Hq", "M": "Sq", "N": "Skv"}
    for dim in fixed:
        assert {getattr(c, field[dim]) for c in cases} == {getattr(own, field[dim])}
    if fixed:
        assert any("held at the spec's own" in n for n in notes)
    else:
        assert any(isinstance(c, ShapeCase) and c.origin == "ragged" for c in cases)


def test_bool_and_bitwise_semantics_follow_torch() -> None:
    """Morton decoding (`&`, `|`, `>>` on int32 indices) and a bool table read through the traced expressions."""
    spec = load_spec(SPECS / "morton_natten.py")
    assert ">>" in spec.variants_text() and "&" in spec.variants_text()
    gym = load_spec(SPECS / "global_sliding_window.py")
    assert gym.aux["IS_GLOBAL"].dtype == torch.bool
    assert math.isclose(spec.softmax_scale, 1 / math.sqrt(64))


@pytest.mark.network  # the session KB ingests the real flash-attn release
@pytest.mark.parametrize("stem", ["morton_natten", "document_causal"])
def test_representative_specs_generate_and_verify(ingested_kb, tmp_path: Path, stem: str) -> None:
    """and_masks (sliding window), integer bit operations (Morton NATTEN) and a mask whose data fixes the
    sequence length (packed documents: verified at the spec's own length, and the verdict says so)."""
    options = dict(QUICK, verify_max_cases=3)
    r = generate(ingested_kb, SPECS / f"{stem}.py", GenerateOptions(out_dir=tmp_path / "out", **options))
    assert r.succeeded, f"{stem}: {r.error}"
    report = json.loads(r.files["report"].read_text())
    assert report["verify"]["verdict"] == "passed"
    held = "Sq, Skv held at the spec's own" in report["verify"]["detail"]
    assert held == (stem == "document_causal"), report["verify"]["detail"]
