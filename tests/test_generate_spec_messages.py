"""Spec tracing names the construct it does not support, at the line that uses it."""

from __future__ import annotations

import re

import pytest

from generate.spec import load_spec
from generate.spec_trace import SCORE_OPS, supported_ops
from kb.errors import KBError
from tests.support.repo import REPO

BAD = REPO / "tests" / "data" / "specs_bad"


@pytest.mark.parametrize("name,says,line", [
    ("loop_over_heads", "a Python loop over heads (torch.fx saw 4 matmuls", "s = q[:, h] @ k[:, h]"),
    ("packed_qkv", "q, k, v sliced from a packed qkv tensor ('qkv') by indexing is not supported; pass q, k, v "
                   "separately", "return torch.softmax(q @ k.transpose"),
])
def test_tracing_names_the_construct(name: str, says: str, line: str) -> None:
    with pytest.raises(KBError) as err:
        load_spec(BAD / f"{name}.py")
    msg = str(err.value)
    assert says in msg and f"{name}.py:" in msg and line in msg
    assert "second matmul" not in msg


def _model_spec(path, *forward: str):
    """A KernelBench spec at `path` whose Model.forward(q, k, v) is the lines `forward` (line 4 is the first)."""
    path.write_text(
        "import torch, torch.nn as nn\n"
        "class Model(nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        + "".join(f"        {line}\n" for line in forward) +
        "def get_inputs():\n    return [torch.randn(1, 2, 8, 16) for _ in range(3)]\n"
        "def get_init_inputs():\n    return []\n")
    return path


def test_two_attentions_are_named(tmp_path) -> None:
    p = _model_spec(tmp_path / "two.py", "a = torch.softmax(q @ k.transpose(-2, -1), -1) @ v",
                    "return torch.softmax(a @ k.transpose(-2, -1), -1) @ v")
    with pytest.raises(KBError, match=r"several attentions in one spec \(torch.fx saw 4 matmuls\).*two.py:5"):
        load_spec(p)


def test_random_unregistered_tensor_is_named() -> None:
    with pytest.raises(KBError, match=r"Model tensor\(s\) bias take a new random value .*register_buffer"):
        load_spec(REPO / "tests" / "data" / "specs_state" / "random_attribute.py")


def test_an_unsupported_op_lists_the_supported_ones(tmp_path) -> None:
    p = _model_spec(tmp_path / "sin.py", "s = torch.sin(q @ k.transpose(-2, -1))", "return torch.softmax(s, -1) @ v")
    with pytest.raises(KBError) as err:
        load_spec(p)
    msg = str(err.value)
    assert "unsupported op in the score/mask computation (aten op sin.default" in msg and "sin.py:4" in msg
    assert f"supported there: {', '.join(sorted(SCORE_OPS))}" in msg


def test_docs_list_the_supported_ops() -> None:
    doc = (REPO / "docs" / "specs.md").read_text()
    section = doc.split("## Supported ops", 1)[1].split("\n## ", 1)[0]
    listed = {m.group(1): tuple(re.findall(r"`([^`]+)`", m.group(2)))
              for m in re.finditer(r"^- ([^:]+): (.*)$", section, re.M)}
    assert listed == supported_ops(), "docs/specs.md's list of supported ops drifted from generate.spec_trace"


def _flex_spec(path, body: str, shapes: str = "dict(B=1, H=2, S=16, D=8)"):
    """A FlexAttention spec at `path` with mask_mod's body `body` (its line 5) and a 16 x 200 int table T."""
    path.write_text("import torch\n"
                    f"SHAPES = {shapes}\n"
                    "T = torch.arange(3200).reshape(16, 200) % 7\n"
                    "def mask_mod(b, h, q_idx, kv_idx):\n"
                    f"    {body}\n")
    return path


def test_flex_mod_errors_name_the_mod_line(tmp_path) -> None:
    p = _flex_spec(tmp_path / "sin_mask.py", "return torch.sin(q_idx.float()) > 0")
    with pytest.raises(KBError, match=r"aten op sin.default, at .*sin_mask.py:5: return torch.sin"):
        load_spec(p)


def test_flex_reduction_is_unrolled_up_to_a_limit(tmp_path) -> None:
    ok = load_spec(_flex_spec(tmp_path / "any4.py", "return (T[q_idx][:4] == kv_idx % 7).any(-1)"))
    assert ok.variants_text().count("T[q_idx,") == 4
    with pytest.raises(KBError, match=r"a reduction over 200 elements \(more than 64 are not unrolled.*any.dim.*any200.py:5"):
        load_spec(_flex_spec(tmp_path / "any200.py", "return (T[q_idx] == kv_idx % 7).any(-1)"))


@pytest.mark.parametrize("dtype,name", [("torch.bfloat16", "bf16"), ("'bfloat16'", "bf16"), ("torch.float16", "fp16"),
                                        ("'fp32'", "fp32")])
def test_flex_shapes_dtype_spellings(tmp_path, dtype: str, name: str) -> None:
    p = _flex_spec(tmp_path / "dt.py", "return q_idx >= kv_idx", f"dict(B=1, H=2, S=16, D=8, dtype={dtype})")
    assert load_spec(p).shapes.dtype == name


def test_flex_shapes_refuse_other_dtypes(tmp_path) -> None:
    p = _flex_spec(tmp_path / "dt.py", "return q_idx >= kv_idx", "dict(B=1, H=2, S=16, D=8, dtype=torch.int32)")
    with pytest.raises(KBError, match=r"SHAPES dtype torch.int32 is not one of fp32, bf16, fp16"):
        load_spec(p)
