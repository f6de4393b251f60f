"""The feature vector of an attention kernel or spec.

Features are derived (from an IR Program by `kb.ir.features.derive`, from a spec by
`generate.spec`), never typed by hand. Both sides produce this one type, so that
retrieval compares like with like.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

__all__ = ["Features", "MASK_KINDS", "SCORE_KINDS", "features_from_untrusted"]

# What kind of mask the kernel applies; "custom" is any other mask_mod.
MASK_KINDS = ("none", "causal", "sliding_window", "document", "prefix_lm", "block_sparse", "custom")
# What kind of score modification; "custom" is any other score_mod.
SCORE_KINDS = ("none", "alibi", "softcap", "relative_bias", "bias_table", "custom")


@dataclass(frozen=True)
class Features:
    mask: str = "none"  # one of MASK_KINDS
    causal: bool = False
    sliding_window: bool = False
    score_mod: str = "none"  # one of SCORE_KINDS
    alibi: bool = False
    softcap: bool = False
    gqa_ratio: int = 1  # Hq / Hkv; 1 = MHA, Hq = MQA
    head_dim: int = 128
    dtype: str = "bf16"
    split_kv: bool = False  # decode-style split over the KV sequence with an LSE combine
    decode: bool = False  # seq_q is tiny (<= 16) compared with seq_kv
    paged_kv: bool = False
    varlen: bool = False
    dropout: bool = False
    return_lse: bool = False
    cross: bool = False  # seq_q and seq_kv independent (cross attention)
    kv_span: int = 0  # keys a query can see when a constant band bounds them (window left + right + 1); 0 = unbounded
    arch: str = "any"  # "sm80", "sm90", "sm100", or "any"
    backward: bool = False  # a backward program: dq, dk, dv from the saved lse (kb.ir.nodes.is_backward)
    sinks: bool = False  # a sink logit (per head, learned: gpt-oss) joins the softmax's denominator and carries no value
    learned_table: bool = False  # a backward that also reduces a learnable aux tensor's gradient (kb.ir.nodes.AuxGrad)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Features":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def describe(self) -> str:
        """A short human/embedding-friendly sentence, e.g. 'causal mask, softcap, gqa 4, d128 bf16'."""
        parts = [f"{self.mask} mask" if self.mask != "none" else "no mask"]
        if self.score_mod != "none":
            parts.append(f"{self.score_mod} score_mod")
        if self.gqa_ratio > 1:
            parts.append(f"gqa ratio {self.gqa_ratio}")
        for flag in ("backward", "split_kv", "decode", "paged_kv", "varlen", "sinks", "dropout", "return_lse", "cross"):
            if getattr(self, flag):
                parts.append(flag.replace("_", " "))
        parts.append(f"head dim {self.head_dim} {self.dtype} {self.arch}")
        return ", ".join(parts)


def features_from_untrusted(text: object) -> Features:
    """Features from JSON text someone else wrote (a sandboxed tracer, a cache file): known fields only, each of its
    declared type (bool is not int here, nor int bool); ValueError otherwise."""
    try:
        data = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ValueError("no features object")
    values = {}
    for f in fields(Features):
        if f.name in data:
            want, value = type(getattr(Features(), f.name)), data[f.name]
            if type(value) is not want:
                raise ValueError(f"{f.name}={value!r} is not a {want.__name__}")
            values[f.name] = value
    return Features(**values)
