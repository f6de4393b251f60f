"""Side-by-side timing of the Triton lowering's portable path and its Hopper path (TMA descriptors,
warp specialization) on causal / plain attention, with correctness against SDPA.

Run on an sm90 GPU: `PYTHONPATH=. python3 -m bench.gpu.hopper --out DIR`. Writes DIR/hopper_h200.json.
Also checks ragged / padded-head shapes: the TMA path must equal the portable path there.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.gpu.suite import load_program, with_schedule
from kb.ir.design import head_bucket
from kb.ir.nodes import Schedule
from kb.lower.runtime import load_module
from kb.lower.triton import LowerOptions, lower_program
from verify.timing import time_fn

log = logging.getLogger(__name__)

# (label, LowerOptions.tma, BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize)
CONFIGS = (
    ("old 128x64 w8 s3", False, 128, 64, 8, 3, False),
    ("old 128x128 w8 s3", False, 128, 128, 8, 3, False),
    ("tma 128x64 w8 s3", True, 128, 64, 8, 3, False),
    ("tma 128x128 w8 s3", True, 128, 128, 8, 3, False),
    ("tma 128x128 w8 s2", True, 128, 128, 8, 2, False),
    ("tma+ws 128x64 w8 s3", True, 128, 64, 8, 3, True),
    ("tma+ws 128x128 w8 s3", True, 128, 128, 8, 3, True),
    ("tma+ws 128x128 w4 s2", True, 128, 128, 4, 2, True),
)


def _module(variant: str, tma: bool, bm: int, bn: int, w: int, st: int, ws: bool):
    prog, _ = load_program(variant)
    p = with_schedule(prog, Schedule(block_m=bm, block_n=bn, num_warps=w, num_stages=st, warp_specialize=ws))
    mod, _ = load_module(lower_program(p, LowerOptions(tma=tma)), f"{variant}_hopper")
    return mod


def _ragged_checks(results: list[dict]) -> None:
    """TMA path == portable path (and ~SDPA) on ragged lengths and padded head dims."""
    for variant, causal in (("causal", True), ("plain", False)):
        for M, D in ((1000, 128), (777, 96), (1000, 64)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(2, 4, M, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            rec = {"kind": "ragged", "variant": variant, "M": M, "D": D}
            try:
                o_old = _module(variant, False, 128, 64, 8, 3, False).forward(q, k, v)[0].float()
                mod = _module(variant, True, 128, 64, 8, 3, False)
                rec["use_tma"] = bool(mod._use_tma((q, k, v), (128, 64, head_bucket(D))))
                o_new = mod.forward(q, k, v)[0].float()
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
                rec.update(err_tma_vs_old=(o_new - o_old).abs().max().item(), err_tma_vs_sdpa=(o_new - ref).abs().max().item(),
                           err_old_vs_sdpa=(o_old - ref).abs().max().item())
            except Exception as err:
                rec["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            log.info("%s", rec)
            print(rec, flush=True)
            results.append(rec)


def main(out: Path, deadline_s: float) -> None:
    t0 = time.time()
    B, H, S, D = 4, 16, 8192, 128
    results: list[dict] = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "shape": [B, H, S, D], "dtype": "bf16", "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    _ragged_checks(results)
    for variant, causal in (("causal", True), ("plain", False)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pairs = S * (S + 1) // 2 if causal else S * S
        flops = 4.0 * B * H * D * pairs
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        impls: list[tuple[str, Callable[..., torch.Tensor] | Exception]] = []  # (label, run or why it could not build)
        for be, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend, q=q, k=k, v=v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            impls.append((be, run))
        for label, tma, bm, bn, w, st, ws in CONFIGS:
            try:
                mod = _module(variant, tma, bm, bn, w, st, ws)
                impls.append((label, lambda mod=mod, q=q, k=k, v=v: mod.forward(q, k, v)[0]))
            except Exception as err:
                impls.append((label, err))
        for label, fn in impls:
            rec: dict[str, str | float] = {"kind": "time", "variant": variant, "impl": label}
            if time.time() - t0 > deadline_s:
                rec["error"] = "skipped: deadline"
            elif isinstance(fn, Exception):
                rec["error"] = f"{type(fn).__name__}: {str(fn)[:400]}"
            else:
                try:
                    o = fn()
                    torch.cuda.synchronize()
                    rec["max_abs_err_vs_cudnn"] = (o.float() - ref.float()).abs().max().item()
                    t = time_fn(fn, warmup=5, trials=30)
                    rec.update(ms=t.median_ms, iqr_ms=t.iqr_ms, tflops=flops / t.median_ms / 1e9)
                except Exception as err:
                    rec["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            print(rec, flush=True)
            results.append(rec)
        del q, k, v, ref
    out.mkdir(parents=True, exist_ok=True)
    (out / "hopper_h200.json").write_text(json.dumps({"env": env, "results": results}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--deadline-s", type=float, default=240.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    main(Path(a.out), a.deadline_s)
