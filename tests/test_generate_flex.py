"""FlexAttention-style specs (module-level score_mod / mask_mod and SHAPES, no Model) generate and
verify like any other: the harness builds a dense-PyTorch Model of the mods (verify.flex)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from generate.pipeline import GenerateOptions, generate
from generate.spec import load_spec, spec_inputs
from tests.support.generate_fixtures import QUICK
from tests.support.repo import REPO
from verify.load import load_spec as load_verify_spec

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

FLEX = sorted((REPO / "examples" / "specs").glob("flex_*.py"))


def test_harness_model_is_the_spec_reference() -> None:
    path = REPO / "examples" / "specs" / "flex_document_softcap.py"
    spec, vspec = load_spec(path), load_verify_spec(path)
    q, k, v = spec_inputs(spec)
    model = vspec.model_cls(*vspec.get_init_inputs())
    assert torch.equal(model(q, k, v), spec.reference(q, k, v))
    assert [tuple(x.shape) for x in vspec.get_inputs()] == [(2, 4, 128, 64)] * 3


@pytest.mark.parametrize("path", FLEX, ids=lambda p: p.stem)
def test_flex_spec_generates_and_verifies(ingested_kb, tmp_path: Path, path: Path) -> None:
    r = generate(ingested_kb, path, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, f"{path.name}: {r.error}"
    report = json.loads(r.files["report"].read_text())
    assert report["verify"]["verdict"] == "passed"
    assert "def forward(self, q, k, v):" in r.files["candidate"].read_text()
