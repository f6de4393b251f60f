"""Spec tracing: every example and labelled spec traces to its features and variant
expressions, and the spec's own torch reference agrees with attention computed from the
extracted expressions (an independent check that tracing is right)."""
import functools
from pathlib import Path

import pytest
import torch

from generate.spec import SpecKind, load_spec, spec_inputs, variants_attention
from kb.errors import KBError
from kb.ir.expr import print_expr

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples" / "specs").glob("*.py"))
LABELLED = sorted((ROOT / "tests" / "data" / "specs").glob("*.py"))
BAD = ROOT / "tests" / "data" / "specs_bad"
TOL = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}


@functools.lru_cache(maxsize=None)
def _load(path: Path):
    """Each spec is traced once per session (tracing is the slow part)."""
    return load_spec(path)


def _label(path: Path) -> dict:
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns["LABEL"]


def _agrees(spec) -> float:
    q, k, v = spec_inputs(spec, seed=1)
    ref = spec.reference(q, k, v).float()
    got = variants_attention(spec, q, k, v).float()
    assert ref.shape == got.shape and not ref.isnan().any()
    return (ref - got).abs().max().item()


def test_set_sizes():
    assert len(EXAMPLES) >= 12 and len(LABELLED) >= 25


@pytest.mark.parametrize("path", LABELLED, ids=lambda p: p.stem)
def test_labelled_spec_features_and_reference(path):
    spec = _load(path)
    label = _label(path)
    assert label["family"] in {"triton_fwd", "fa2_cuda", "triton_decode", "cute_fa4", "cutlass_fmha", "serving_triton"}
    got = {k: getattr(spec.features, k) for k in label["features"]}
    assert got == label["features"]
    assert _agrees(spec) <= TOL[spec.shapes.dtype]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_spec_reference_agrees(path):
    spec = _load(path)
    assert _agrees(spec) <= TOL[spec.shapes.dtype]


EXPECTED = {
    # example -> (score_mod text, mask_mod text, features.mask, features.score_mod)
    "causal_d64": (None, "kv_idx <= q_idx", "causal", "none"),
    "causal_gqa_d128": (None, "q_idx >= kv_idx", "causal", "none"),
    "alibi": ("score + slopes[h] * (kv_idx - q_idx)", None, "causal", "alibi"),
    "sliding_window": (None, "(q_idx - kv_idx >= 0) & (q_idx - kv_idx < 32)", "sliding_window", "none"),
    "softcap_causal": ("tanh(score / 50.0) * 50.0", "kv_idx <= q_idx", "causal", "softcap"),
    "document_mask": (None, "(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)", "document", "none"),
    "prefix_lm": (None, "(kv_idx < 24) | (kv_idx <= q_idx)", "prefix_lm", "none"),
    # its table has 2 * max_len - 1 columns (max_len a constructor argument): the offset is read from the table's size
    "relative_bias": ("score + rel_bias[h, q_idx - kv_idx + (rel_bias_n1 - 1) // 2]", None, "none", "relative_bias"),
    "mqa": (None, None, "none", "none"),
    "cross_attention": (None, None, "none", "none"),
    "decode_gqa_splitkv": (None, None, "none", "none"),
    "sdpa_causal_d128_bf16": (None, "kv_idx <= q_idx", "causal", "none"),
    "chunked_prefill_bottom_right": (None, "kv_idx <= q_idx + (N - M)", "causal", "none"),
    "flex_alibi_causal": ("score + SLOPES[h] * (kv_idx - q_idx)", "q_idx >= kv_idx", "causal", "alibi"),
    "flex_document_softcap": ("tanh(score / 30.0) * 30.0", "(DOC_IDS[b, q_idx] == DOC_IDS[b, kv_idx]) & (q_idx >= kv_idx)",
                              "document", "softcap"),
    "flex_sliding_window_gqa": (None, "(q_idx >= kv_idx) & (q_idx - kv_idx < 48)", "sliding_window", "none"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_expressions(name):
    spec = _load(ROOT / "examples" / "specs" / f"{name}.py")
    score, mask, mkind, skind = EXPECTED[name]
    assert (spec.score_mod and print_expr(spec.score_mod)) == score
    if mask is not None or name != "alibi":
        assert (spec.mask_mod and print_expr(spec.mask_mod)) == mask
    assert (spec.features.mask, spec.features.score_mod) == (mkind, skind)


def test_example_shapes_scale_aux_and_kind():
    gqa = _load(ROOT / "examples" / "specs" / "causal_gqa_d128.py")
    assert (gqa.shapes.Hq, gqa.shapes.Hkv, gqa.shapes.D, gqa.features.gqa_ratio, gqa.scale) == (8, 2, 128, 4, None)
    assert gqa.kind is SpecKind.KERNELBENCH and len(gqa.source_hash) == 64
    alibi = _load(ROOT / "examples" / "specs" / "alibi.py")
    assert set(alibi.aux) == {"slopes"} and alibi.aux["slopes"].shape == (8,)
    decode = _load(ROOT / "examples" / "specs" / "decode_gqa_splitkv.py")
    assert (decode.features.decode, decode.features.split_kv, decode.shapes.dtype) == (True, True, "bf16")
    both = _load(ROOT / "examples" / "specs" / "flex_sliding_window_gqa.py")
    assert both.kind is SpecKind.BOTH and both.features.gqa_ratio == 4
    flex = _load(ROOT / "examples" / "specs" / "flex_document_softcap.py")
    assert flex.kind is SpecKind.FLEX and set(flex.aux) == {"DOC_IDS"}


def test_explicit_scale_kept(tmp_path):
    p = tmp_path / "scaled.py"
    p.write_text(
        "import torch, torch.nn as nn\n"
        "class Model(nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        return torch.softmax((q @ k.transpose(-2, -1)) * 0.5, -1) @ v\n"
        "def get_inputs():\n    return [torch.randn(1, 2, 8, 16) for _ in range(3)]\n"
        "def get_init_inputs():\n    return []\n")
    spec = load_spec(p)
    assert spec.scale == 0.5 and spec.score_mod is None and spec.mask_mod is None


def test_matrix_transpose_attribute_spelling(tmp_path):
    p = tmp_path / "mt.py"
    p.write_text(
        "import torch, torch.nn as nn\n"
        "class Model(nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        bias = torch.full((q.shape[2], q.shape[2]), float('-inf')).triu(1)\n"
        "        return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5 + bias, -1) @ v\n"
        "def get_inputs():\n    return [torch.randn(1, 2, 8, 16) for _ in range(3)]\n"
        "def get_init_inputs():\n    return []\n")
    spec = load_spec(p)
    assert spec.features.mask == "causal" and spec.scale is None


def test_flex_fully_masked_rows_give_zero(tmp_path):
    p = tmp_path / "empty_rows.py"
    p.write_text("SHAPES = dict(B=1, Hq=1, M=8, N=8, D=4)\n"
                 "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx >= kv_idx) & (q_idx > 2)\n")
    spec = load_spec(p)
    q, k, v = spec_inputs(spec)
    out = spec.reference(q, k, v)
    assert torch.equal(out[0, 0, :3], torch.zeros(3, 4)) and out[0, 0, 3:].abs().sum() > 0
    assert torch.allclose(out, variants_attention(spec, q, k, v), atol=1e-6)


_T5_HF = """import math
import torch, torch.nn as nn

def bucket(rel, bidirectional, num_buckets=16, max_distance=22):
    out = 0
    if bidirectional:
        num_buckets //= 2
        out += (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    exact = num_buckets // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    out += torch.where(rel < exact, rel, large)
    return out

class Model(nn.Module):
    def __init__(self, n_heads):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(16, n_heads)

    def forward(self, q, k, v):
        m, n = q.shape[2], k.shape[2]
        rel = torch.arange(n, dtype=torch.long)[None, :] - torch.arange(m, dtype=torch.long)[:, None]
        values = self.relative_attention_bias(bucket(rel, BIDIRECTIONAL)).permute([2, 0, 1]).unsqueeze(0)
        scores = torch.matmul(q, k.transpose(3, 2)) + values
        if not BIDIRECTIONAL:
            scores = scores + torch.triu(torch.full((m, n), -1e9), diagonal=1)
        return torch.matmul(nn.functional.softmax(scores.float(), dim=-1).type_as(scores), v)

def get_inputs():
    return [torch.randn(1, 2, 40, 16) for _ in range(3)]

def get_init_inputs():
    return [2]
"""


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_t5_buckets_in_the_transformers_spelling(tmp_path, bidirectional):
    """`out += ...`, torch.min(a, b), .to(torch.long) of a log and an nn.Embedding lookup: the learnable table
    stays an aux tensor read at `trunc(...)`-computed buckets."""
    p = tmp_path / "t5_hf.py"
    p.write_text(f"BIDIRECTIONAL = {bidirectional}\n" + _T5_HF)
    spec = load_spec(p)
    score = print_expr(spec.score_mod)
    assert score.startswith("score + relative_attention_bias_weight[") and "trunc(log(" in score
    assert [(e.key, e.parameter, e.aux) for e in spec.state] == [
        ("relative_attention_bias.weight", True, "relative_attention_bias_weight")]
    assert spec.features.mask == ("none" if bidirectional else "causal")
    assert _agrees(spec) <= TOL["fp32"]


_INPLACE_SPEC = """import torch, torch.nn as nn
class Model(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[2]
        d = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        {body}
        return torch.softmax(q @ k.transpose(-2, -1) + bias, -1) @ v
def get_inputs():
    return [torch.randn(1, 2, 8, 16) for _ in range(3)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("body,match", [
    ("seen = d.view(n, n); d += 1; bias = (d + seen).float()", "in-place add_ of a tensor also used elsewhere"),
    ("d[:, 0] += 1; bias = d.float()", "in-place add_ on a view"),
    ("bias = (d * 0.7).to(torch.int16).float()", "float to torch.int16 cast"),
    ("v.mul_(2); bias = d.float()", "in-place mul_ of a forward input"),
    ("bias = torch.max(d.float(), dim=-1).values[:, None]", "torch.max as a reduction"),
])
def test_unsupported_casts_and_updates_are_named(tmp_path, body, match):
    p = tmp_path / "bad.py"
    p.write_text(_INPLACE_SPEC.format(body=body))
    with pytest.raises(KBError, match=match):
        load_spec(p)


def test_inplace_update_without_aliases_is_traced(tmp_path):
    p = tmp_path / "inplace.py"
    p.write_text(_INPLACE_SPEC.format(body="bias = d.float(); bias *= 0.5; bias.clamp_(min=-2.0)"))
    spec = load_spec(p)
    assert print_expr(spec.score_mod) == "score + maximum((kv_idx - q_idx) * 0.5, -2.0)"
    assert _agrees(spec) <= TOL["fp32"]


@pytest.mark.parametrize("name,op", [
    ("dropout_training", "dropout"), ("op_after_softmax", "pow"), ("not_attention", "linear"),
    ("repeat_tiles_heads", "repeat"),
])
def test_unsupported_specs_name_the_op(name, op):
    path = BAD / f"{name}.py"
    with pytest.raises(KBError) as err:
        load_spec(path)
    msg = str(err.value)
    assert f"aten op {op}" in msg and f"{name}.py:" in msg


def test_not_a_spec(tmp_path):
    p = tmp_path / "nothing.py"
    p.write_text("x = 1\n")
    with pytest.raises(KBError, match="not a spec"):
        load_spec(p)
    with pytest.raises(KBError, match="does not exist"):
        load_spec(tmp_path / "missing.py")
    bad = tmp_path / "flex_no_shapes.py"
    bad.write_text("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n")
    with pytest.raises(KBError, match="SHAPES"):
        load_spec(bad)
