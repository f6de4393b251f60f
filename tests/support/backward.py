"""Backward fixtures shared by the transfer, lifting and lowering tests: the variant classes' specs and their
transferred forward/backward programs, and FA2's Triton backward lifted from the pinned sdist."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from generate.spec import load_spec
from generate.target import target_for
from generate.transfer import Strategy, transfer
from generate.transfer_bwd import backward_target, transfer_backward
from ingest.fetch import fetch
from ingest.lift_triton import lift_file
from ingest.manifest import find_manifest
from ingest.model import LiftReport, Provenance
from kb.ir.text import parse_program
from kb.ir.validate import validate
from tests.support.ir_programs import backward_text
from tests.support.repo import REPO

SPECS = REPO / "tests" / "data" / "specs"
GOLDEN = REPO / "tests" / "golden" / "ir"
# the causal FA2 backward structure (what ingest lifts from flash_attn_triton.py's _bwd_kernel)
REFERENCE = parse_program(backward_text("fa2_bwd_causal", mask_mod="q_idx >= kv_idx", m_lo="n_start // BLOCK_M * BLOCK_M"))

CLASSES = {
    "causal": "causal_where_d128.py",
    "sliding_window": "sliding_window_32.py",
    "alibi": "alibi_causal.py",
    "softcap_gqa": "softcap_causal_gqa.py",
    "document": "document_causal.py",
    "prefix_lm": "prefix_lm_16.py",
    "gqa": "causal_gqa4_interleave.py",
    "relative_bias_learnable": "relative_bias_table.py",
}


def transferred_programs(spec_file: str | Path) -> tuple:
    """The rule engine's forward and backward of a spec (a name in tests/data/specs, or a path): (spec, fwd, bwd,
    backward target)."""
    spec = load_spec(spec_file if isinstance(spec_file, Path) else SPECS / spec_file)
    fwd = transfer(parse_program((GOLDEN / "causal.kbir").read_text()), target_for(spec), Strategy.BLOCK_MASK, name="fwd")
    learnable = tuple(e.aux for e in spec.state if e.parameter and e.aux)
    target = backward_target(fwd, learnable, (spec.shapes.M, spec.shapes.N))
    bwd = transfer_backward(REFERENCE, target, name="bwd")
    validate(bwd)
    return spec, fwd, bwd, target


FA2 = "flash_attn/flash_attn_triton.py"


def fa2_provenance(rel: str) -> Provenance:
    return Provenance("flash-attn", "2.8.3.post2", rel, 1, 1, "triton", "")


@lru_cache(maxsize=None)
def fa2_triton_lift() -> tuple[Path, LiftReport]:
    """FA2's flash_attn_triton.py from the pinned sdist and what the Triton lifter makes of it (KB_CACHE_DIR set by the caller)."""
    src = fetch(find_manifest("flash-attn-2"))
    (top,) = [p for p in src.root.iterdir() if p.is_dir()]
    return top / FA2, lift_file(top / FA2, fa2_provenance(f"{top.name}/{FA2}"), "fa2_triton")
