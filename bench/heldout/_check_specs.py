"""CPU self-check of the held-out specs (no GPU, no Triton).

For every spec in this folder:
  * build Model(*get_init_inputs()), run it on get_inputs() (seed 0);
  * compute a dense reference from flex_mods: score_mod / mask_mod evaluated on broadcast
    int32 index tensors (b, h, q_idx, kv_idx), fp32, softmax, @ v, GQA by repeat_interleave,
    scale = SCALE or 1/sqrt(D); rows with no visible key give 0 (as FlexAttention does);
  * max abs error Model vs reference < 2e-2 (bf16 inputs) or < 1e-4 (fp32 inputs);
  * if SDPA is "causal"/"none": F.scaled_dot_product_attention (fp32, enable_gqa) matches the
    reference; if SDPA is None: neither SDPA form matches it (the variant is not plain SDPA);
  * the mods change the result at the small shape (not a no-op there);
  * output dtype == input dtype, except in exactly one spec whose docstring says "fp32 output";
  * bench: Model(*bench_init_inputs()) (or get_init_inputs()) constructs, bench_inputs('cpu')
    gives bf16 q [B,Hq,M,D], k [B,Hkv,N,D], v [B,Hkv,N,Dv] (Dv = BENCH.get("Dv", D); aux inputs integer), and the mods
    built on the bench inputs evaluate at corner indices of the bench shape. The Model itself
    is never run at the bench shape.
Suite checks: >= 14 specs, >= 4 with D=64 and >= 4 with D=128, >= 8 with bf16 inputs,
at least half with a ragged small S (not a multiple of 64).

Run: .venv/bin/python bench/heldout/_check_specs.py   (exit status 1 on any failure)
"""
import gc
import importlib.util
import inspect
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
BENCH_KEYS = {"B", "Hq", "Hkv", "M", "N", "D"}


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"heldout_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call_flex_mods(mod, inputs, model):
    fn = mod.flex_mods
    if "model" in inspect.signature(fn).parameters:
        return fn(*inputs, model=model)
    return fn(*inputs)


def dense_reference(mod, inputs, model):
    q, k, v = (t.float() for t in inputs[:3])
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = getattr(mod, "SCALE", None)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    score_mod, mask_mod = call_flex_mods(mod, inputs, model)
    b = torch.arange(B, dtype=torch.int32).view(B, 1, 1, 1)
    h = torch.arange(Hq, dtype=torch.int32).view(1, Hq, 1, 1)
    qi = torch.arange(M, dtype=torch.int32).view(1, 1, M, 1)
    ki = torch.arange(N, dtype=torch.int32).view(1, 1, 1, N)
    if score_mod is not None:
        s = torch.broadcast_to(score_mod(s, b, h, qi, ki), s.shape).float()
    if mask_mod is not None:
        keep = torch.broadcast_to(mask_mod(b, h, qi, ki), s.shape)
        assert keep.dtype == torch.bool, f"mask_mod returned {keep.dtype}"
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)      # fully masked rows -> 0
    return p @ v, score_mod is not None or mask_mod is not None


def plain_attention(inputs, causal, scale):
    q, k, v = (t.float() for t in inputs[:3])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def check_bench(mod):
    bench = mod.BENCH
    assert BENCH_KEYS <= set(bench) <= BENCH_KEYS | {"Dv"}, f"BENCH keys {sorted(bench)}"
    init = mod.bench_init_inputs() if hasattr(mod, "bench_init_inputs") else mod.get_init_inputs()
    model = mod.Model(*init).eval()
    ins = mod.bench_inputs("cpu")
    B, Hq, Hkv, M, N, D = (bench[x] for x in ("B", "Hq", "Hkv", "M", "N", "D"))
    Dv = bench.get("Dv", D)
    q, k, v = ins[:3]
    assert tuple(q.shape) == (B, Hq, M, D), f"bench q {tuple(q.shape)}"
    assert tuple(k.shape) == (B, Hkv, N, D), f"bench k {tuple(k.shape)}"
    assert tuple(v.shape) == (B, Hkv, N, Dv), f"bench v {tuple(v.shape)}"
    assert all(t.dtype == torch.bfloat16 for t in (q, k, v)), "bench q/k/v not bf16"
    for t in ins[3:]:
        assert not t.is_floating_point(), f"aux input {t.dtype} is not integer"
    if M == 1:
        assert B * N >= 8 * 8192 and 64 <= B <= 128, "decode bench shape"
    score_mod, mask_mod = call_flex_mods(mod, ins, model)
    b = torch.tensor([0, B - 1], dtype=torch.int32).view(2, 1, 1, 1)
    h = torch.tensor([0, Hq - 1], dtype=torch.int32).view(1, 2, 1, 1)
    qi = torch.tensor([0, M // 2, M - 1], dtype=torch.int32).view(1, 1, 3, 1)
    ki = torch.tensor([0, N // 2, N - 1], dtype=torch.int32).view(1, 1, 1, 3)
    if score_mod is not None:
        out = score_mod(torch.zeros(2, 2, 3, 3), b, h, qi, ki)
        assert torch.broadcast_to(out, (2, 2, 3, 3)).isfinite().all(), "bench score_mod not finite"
    if mask_mod is not None:
        out = mask_mod(b, h, qi, ki)
        assert out.dtype == torch.bool, "bench mask_mod not bool"
        torch.broadcast_to(out, (2, 2, 3, 3))
    del ins, q, k, v, model
    gc.collect()
    return f"B{B} H{Hq}/{Hkv} {M}x{N} D{D}"


def main():
    paths = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))
    rows, failures, out_dtype_exceptions = [], [], []
    n_d64 = n_d128 = n_bf16 = n_ragged = 0
    for path in paths:
        name = path.stem
        status, err, tol, vdelta, sdpa_msg, bench_msg, dt_msg, small = "ok", float("nan"), 0.0, float("nan"), "", "", "", ""
        try:
            mod = load(path)
            assert mod.__doc__ and mod.__doc__.strip(), "missing docstring"
            for attr in ("Model", "get_inputs", "get_init_inputs", "bench_inputs", "flex_mods", "BENCH", "SDPA"):
                assert hasattr(mod, attr), f"missing {attr}"
            assert mod.SDPA in ("causal", "none", None), f"SDPA={mod.SDPA!r}"
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs()).eval()
            inputs = mod.get_inputs()
            q, k = inputs[0], inputs[1]
            B, Hq, M, D = q.shape
            Hkv, N = k.shape[1], k.shape[2]
            small = f"B{B} H{Hq}/{Hkv} {M}x{N} D{D}"
            assert B <= 2 and Hq <= 4, "small shape too large"
            n_d64 += D == 64
            n_d128 += D == 128
            n_bf16 += q.dtype == torch.bfloat16
            n_ragged += (N % 64 != 0) or (M > 1 and M % 64 != 0)
            with torch.no_grad():
                out = model(*inputs)
                ref, has_mods = dense_reference(mod, inputs, model)
            dt_msg = f"{str(q.dtype)[6:]}->{str(out.dtype)[6:]}"
            if out.dtype != q.dtype:
                out_dtype_exceptions.append(name)
                assert "fp32 output" in mod.__doc__, "output dtype differs from input dtype, docstring does not say so"
            assert tuple(out.shape) == tuple(ref.shape), f"out shape {tuple(out.shape)} != {tuple(ref.shape)}"
            assert torch.isfinite(out).all(), "Model output not finite"
            tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-4
            err = (out.float() - ref).abs().max().item()
            assert err < tol, f"max abs err {err:.3g} >= {tol}"
            scale = getattr(mod, "SCALE", None)
            with torch.no_grad():
                plain = plain_attention(inputs, False, scale)
                causal = plain_attention(inputs, True, scale) if M == N else None
            vdelta = (plain - ref).abs().max().item()
            if has_mods:
                assert vdelta > 1e-2, f"mods are a no-op at the small shape (delta {vdelta:.3g})"
            if mod.SDPA == "none":
                assert vdelta < 1e-4, f"SDPA='none' but differs by {vdelta:.3g}"
                sdpa_msg = f"none {vdelta:.1e}"
            elif mod.SDPA == "causal":
                d = (causal - ref).abs().max().item()
                assert d < 1e-4, f"SDPA='causal' but differs by {d:.3g}"
                sdpa_msg = f"causal {d:.1e}"
            else:
                dc = float("inf") if causal is None else (causal - ref).abs().max().item()
                assert min(vdelta, dc) > 1e-2, "SDPA=None but SDPA matches"
                sdpa_msg = "None (differs)"
            bench_msg = check_bench(mod)
        except Exception as e:
            status = f"FAIL: {type(e).__name__}: {e}"
            failures.append(name)
        rows.append((name, small, dt_msg, f"{err:.2e}", f"{tol:.0e}", f"{vdelta:.2f}", sdpa_msg, bench_msg, status))
        gc.collect()

    head = ("spec", "small shape", "dtype", "max err", "tol", "mods effect", "SDPA check", "bench shape (bf16)", "status")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    def line(r):
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))

    suite = []
    if len(paths) < 14:
        suite.append(f"only {len(paths)} specs (< 14)")
    if n_d64 < 4 or n_d128 < 4:
        suite.append(f"D=64: {n_d64}, D=128: {n_d128} (need >= 4 each)")
    if n_bf16 < 8:
        suite.append(f"bf16 specs: {n_bf16} (< 8)")
    if 2 * n_ragged < len(paths):
        suite.append(f"ragged specs: {n_ragged} of {len(paths)} (< half)")
    if len(out_dtype_exceptions) > 1:
        suite.append(f"output dtype differs in {out_dtype_exceptions} (at most one allowed)")
    print(f"\nspecs: {len(paths)}  D=64: {n_d64}  D=128: {n_d128}  bf16 inputs: {n_bf16}  "
          f"ragged: {n_ragged}  fp32-output-from-bf16: {out_dtype_exceptions}")
    for s in suite:
        print("SUITE FAIL:", s)
    if failures or suite:
        print(f"FAILED: {failures}")
        sys.exit(1)
    print("all specs pass")


if __name__ == "__main__":
    main()
