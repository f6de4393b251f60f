"""H200: generated forward+backward (kb_attention) vs compiled FlexAttention, bf16, B4 H16 S4K D128.

Needs only torch and triton (the modules bwd_lowering_gen.py wrote, in DIR/mods beside this file's copy). Usage:
  BWD="BM,BN,splits,warps,stages,tma;..." [FLEX=0] python3 bwd_lowering_bench.py causal causal+dqpass ...
Writes $OUT/bench_bwd.json; ours_bwd_ms times the backward host alone at each design in BWD."""
# ruff: noqa: E731  (score_mod / mask_mod lambdas, as FlexAttention users write them)
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from triton.testing import do_bench
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import torch._dynamo

torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.cache_size_limit = 256
FLEX = torch.compile(flex_attention, dynamic=False)
HERE = Path(__file__).parent
OUT = Path(os.environ.get("OUT", "/tmp"))
W, CAP = 1024, 30.0
B, HQ, S, D = int(os.environ.get("BB", 4)), 16, int(os.environ.get("SS", 4096)), 128
BWD_DESIGNS = [tuple(int(x) for x in d.split(",")) + (False,) for d in os.environ.get("BWD", "64,128,1,8,2,1").split(";")]


def load(name):
    spec = importlib.util.spec_from_file_location(f"m_{name}", HERE / "mods" / f"mod_{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def setup(name, dev):
    hkv = 4 if name == "gqa" else HQ
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, HQ, S, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, hkv, S, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(B, hkv, S, D, device=dev, generator=g, dtype=torch.bfloat16)
    aux, ours_kw, score, mask, per_b = {}, {}, None, None, False
    causal = lambda b, h, qi, ki: qi >= ki
    if name in ("causal", "gqa", "alibi", "softcap", "rel_bias"):
        mask = causal
    if name == "sliding_window":
        mask = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W)
    if name == "alibi":
        slopes = torch.exp2(-torch.arange(1, HQ + 1, device=dev, dtype=torch.float32) * 8.0 / HQ)
        ours_kw["slopes"] = slopes
        score = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    if name == "softcap":
        ours_kw["softcap"] = CAP
        score = lambda s, b, h, qi, ki: CAP * torch.tanh(s / CAP)
    if name == "document":
        bounds = torch.cumsum(torch.randint(S // 16, S // 4, (B, 16), device=dev, generator=g), 1)
        docs = (torch.arange(S, device=dev)[None, :, None] >= bounds[:, None, :]).sum(-1).to(torch.int32)
        ours_kw["doc_ids"] = docs
        mask = lambda b, h, qi, ki: (docs[b, qi] == docs[b, ki]) & (qi >= ki)
        per_b = True
    if name == "rel_bias":
        rel = (0.1 * torch.randn(HQ, 2 * S - 1, device=dev, generator=g)).requires_grad_()
        ours_kw["rel"] = rel
        aux["rel"] = rel
        score = lambda s, b, h, qi, ki: s + rel[h, qi - ki + S - 1]
    return q, k, v, ours_kw, aux, score, mask, per_b


def pairs(mask, per_b, dev):
    if mask is None:
        return B * S * S
    qi = torch.arange(S, device=dev).view(-1, 1)
    ki = torch.arange(S, device=dev).view(1, -1)
    n = 0
    for b in range(B if per_b else 1):
        n += int(mask(torch.tensor(b, device=dev), 0, qi, ki).sum())
    return n if per_b else n * B


def run(modname):
    dev = "cuda"
    name = modname.split("+")[0]
    mod = load(modname)
    q, k, v, kw, aux, score, mask, per_b = setup(name, dev)
    gqa = k.shape[1] != HQ
    bm = create_block_mask(mask, B if per_b else None, None, S, S, device=dev) if mask else None
    leaves = [q, k, v, *aux.values()]
    for t in (q, k, v):
        t.requires_grad_()
    flex = lambda: FLEX(q, k, v, score_mod=score, block_mask=bm, enable_gqa=gqa)
    ours = lambda: mod.kb_attention(q, k, v, **kw)
    dout = torch.randn_like(q)
    res = {"variant": modname, "B": B, "Hq": HQ, "Hkv": k.shape[1], "S": S, "D": D}
    grads = {}
    labels = [("flex", flex), ("ours", ours)] if os.environ.get("FLEX", "1") == "1" else [("ours", ours)]
    for label, fn in labels:
        t0 = time.time()
        for t in leaves:
            t.grad = None
        try:
            o = fn()
            o.backward(dout)
            torch.cuda.synchronize()
        except Exception as e:
            res[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        grads[label] = [o.detach().float()] + [t.grad.float().clone() for t in leaves]
        res[f"{label}_first_call_s"] = round(time.time() - t0, 1)
    if len(grads) == 2:
        errs = [float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(grads["ours"], grads["flex"])]
        res["rel_err_vs_flex"] = dict(zip(["o", "dq", "dk", "dv", *aux], [round(e, 5) for e in errs]))

    def fwd_bwd(fn):
        def go():
            o = fn()
            o.backward(dout)
        return go
    for label, fn in labels:
        if label in grads:
            res[f"{label}_fwd_ms"] = do_bench(fn, warmup=5, rep=50)
            res[f"{label}_fwdbwd_ms"] = do_bench(fwd_bwd(fn), warmup=5, rep=50, grad_to_none=leaves)
    # backward designs, backward host alone
    o, lse = mod.forward(q.detach(), k.detach(), v.detach(), **{n: t.detach() if torch.is_tensor(t) else t for n, t in kw.items()})
    bk = {n: t.detach() if torch.is_tensor(t) else t for n, t in kw.items()}
    res["ours_bwd_ms"] = {}
    for d in BWD_DESIGNS:
        try:
            mod.backward(q.detach(), k.detach(), v.detach(), o, dout, lse, _design=d, **bk)
            res["ours_bwd_ms"][str(d[:6])] = round(do_bench(lambda: mod.backward(q.detach(), k.detach(), v.detach(), o, dout, lse, _design=d, **bk), warmup=5, rep=50), 4)
        except Exception as e:
            res["ours_bwd_ms"][str(d[:6])] = f"error: {type(e).__name__}: {str(e)[:200]}"
    n = pairs(mask, per_b, dev)
    res["attended_pairs"] = n
    best = min([v for v in res["ours_bwd_ms"].values() if isinstance(v, float)], default=None)
    if best is not None:
        res["ours_fwd_plus_best_bwd_ms"] = round(res["ours_fwd_ms"] + best, 4)
    if "flex_fwdbwd_ms" in res:
        res["speedup_fwdbwd"] = round(res["flex_fwdbwd_ms"] / res["ours_fwdbwd_ms"], 3)
        res["speedup_bwd"] = round((res["flex_fwdbwd_ms"] - res["flex_fwd_ms"]) / (res["ours_fwdbwd_ms"] - res["ours_fwd_ms"]), 3)
        if best is not None:
            res["speedup_fwdbwd_best_design"] = round(res["flex_fwdbwd_ms"] / res["ours_fwd_plus_best_bwd_ms"], 3)
    return res


results = []
for name in sys.argv[1:]:
    try:
        r = run(name)
    except Exception as e:
        r = {"variant": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(r), flush=True)
    results.append(r)
    (OUT / "bench_bwd.json").write_text(json.dumps(results, indent=1))
