"""Bounds of expressions over a box (kb/ir/interval.py): every pointwise value lies within them, and they are tight
where the lowering relies on it (a T5 bucket past its largest distance is one value over a whole tile)."""

from __future__ import annotations

import random

import pytest
import torch

from kb.ir.evaluate import eval_expr
from kb.ir.expr import parse_expr
from kb.ir.interval import bounds

T5_BUCKET = ("where(kv_idx - q_idx > 0, 1, 0) * 16 + where(abs(kv_idx - q_idx) < 8, abs(kv_idx - q_idx), "
             "minimum(trunc(log(maximum(abs(kv_idx - q_idx), 1) / 8) / 2.4849066497880004 * 8) + 8, 15))")
EXPRS = [
    T5_BUCKET,
    "(kv_idx - q_idx) * 3 - h",
    "-(q_idx - kv_idx) * -2",
    "(q_idx // 7) * (kv_idx - 40)",
    "(q_idx >> 2) + cdiv(kv_idx, 16)",
    "where((q_idx >= kv_idx) & ~(q_idx - kv_idx > 9), q_idx - kv_idx, 100)",
    "where((q_idx == kv_idx) | (kv_idx != 3), 1, 0)",
    "minimum(maximum(kv_idx - q_idx, -12), 12) + abs(q_idx - 30)",
    "exp2(abs(kv_idx - q_idx) * -0.25) + tanh((q_idx - kv_idx) / 50.0)",
    "sqrt(q_idx + kv_idx + 0.5) / -3.0",
    "where(kv_idx > q_idx, 1.0, 0.0) * where(kv_idx < q_idx + 5, 2.0, 0.5)",
]


def _tile(q0: int, k0: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    return {"q_idx": torch.arange(q0, q0 + rows)[:, None], "kv_idx": torch.arange(k0, k0 + cols)[None, :],
            "h": torch.tensor(3)}


@pytest.mark.parametrize("text", EXPRS)
def test_every_value_of_a_tile_lies_within_its_bounds(text: str) -> None:
    e = parse_expr(text)
    box = {"q_idx": (parse_expr("q0"), parse_expr("q0 + rows - 1")), "kv_idx": (parse_expr("k0"), parse_expr("k0 + cols - 1"))}
    r = bounds(e, box)
    assert r is not None
    rng = random.Random(7)
    for _ in range(40):
        q0, k0, rows, cols = rng.randrange(0, 300), rng.randrange(0, 300), rng.choice((1, 16, 64)), rng.choice((1, 32, 64))
        env = _tile(q0, k0, rows, cols)
        values = torch.as_tensor(eval_expr(e, env)).double()
        # the ends in the pointwise precision (0-d tensors: float32 math), as the kernel computes both
        point = {k: torch.tensor(v) for k, v in {"q0": q0, "k0": k0, "rows": rows, "cols": cols, "h": 3}.items()}
        lo, hi = (float(torch.as_tensor(eval_expr(x, point))) for x in r)
        assert lo <= values.min().item() and values.max().item() <= hi, (text, q0, k0, rows, cols, lo, hi)


def test_a_t5_bucket_is_one_value_over_a_tile_past_its_largest_distance() -> None:
    r = bounds(parse_expr(T5_BUCKET), {"q_idx": (parse_expr("q0"), parse_expr("q0 + 63")),
                                       "kv_idx": (parse_expr("k0"), parse_expr("k0 + 63"))})
    assert r is not None
    ends = [[int(eval_expr(x, {"q0": q0, "k0": k0})) for x in r] for q0, k0 in ((0, 192), (512, 0), (0, 64), (64, 64))]
    assert ends[0] == [31, 31] and ends[1] == [15, 15]  # all keys far after / far before: one bucket
    assert ends[2][0] < ends[2][1] and ends[3][0] < ends[3][1]  # near the diagonal: a span (loose: never narrowed)


def test_no_rule_gives_none() -> None:
    box = {"q_idx": (parse_expr("q0"), parse_expr("q1"))}
    for text in ("tbl[q_idx]", "q_idx % 8", "q_idx / kv_idx", "(q_idx & 3) + 1", "where(q_idx, 1, 0)"):
        assert bounds(parse_expr(text), box) is None, text
