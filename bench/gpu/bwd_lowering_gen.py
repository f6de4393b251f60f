"""Write combined forward+backward modules (lower_autograd) for bench/gpu/bwd_lowering_bench.py: for each variant the
KV-outer program with dq by atomics (mod_NAME.py) and with dq by a separate pass (mod_NAME+dqpass.py).
Usage (here, no GPU): PYTHONPATH=. python3 bench/gpu/bwd_lowering_gen.py DIR"""
import sys
from pathlib import Path
from typing import Any
from kb.ir.design import Design
from kb.ir.nodes import Dtype, Param, Role, Schedule
from kb.lower.triton_bwd import lower_autograd
from tests.support.ir_programs import backward, forward

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
W = 1024
SLIDE = "n_start // BLOCK_M * BLOCK_M"
CAUSAL_HI = "minimum(N, m_start + BLOCK_M)"
V: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name: (forward kwargs, backward kwargs)
 "plain": (dict(), dict()),
 "causal": (dict(mask_mod="q_idx >= kv_idx", hi=CAUSAL_HI, block_classes=True),
            dict(mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True)),
 "sliding_window": (dict(mask_mod=f"(q_idx >= kv_idx) & (q_idx - kv_idx < {W})", lo=f"maximum(0, (m_start - {W - 1}) // BLOCK_N * BLOCK_N)", hi=CAUSAL_HI, block_classes=True),
                    dict(mask_mod=f"(q_idx >= kv_idx) & (q_idx - kv_idx < {W})", m_lo=SLIDE, m_hi=f"minimum(M, n_start + BLOCK_N + {W - 1})", block_classes=True)),
 "alibi": (dict(score_mod="score + slopes[h] * (kv_idx - q_idx)", mask_mod="q_idx >= kv_idx", hi=CAUSAL_HI, block_classes=True, aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),)),
           dict(score_mod="score + slopes[h] * (kv_idx - q_idx)", mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True, aux=(Param("slopes", ("Hq",), Dtype.F32, Role.AUX),))),
 "softcap": (dict(score_mod="softcap * tanh(score / softcap)", mask_mod="q_idx >= kv_idx", hi=CAUSAL_HI, block_classes=True, scalars=("softcap",)),
             dict(score_mod="softcap * tanh(score / softcap)", mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True, scalars=("softcap",))),
 "document": (dict(mask_mod="(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)", hi=CAUSAL_HI, block_classes=True, aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),)),
              dict(mask_mod="(doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)", m_lo=SLIDE, block_classes=True, skip_empty=True, aux=(Param("doc_ids", ("B", "N"), Dtype.I32, Role.AUX),))),
 "gqa": (dict(mask_mod="q_idx >= kv_idx", hi=CAUSAL_HI, block_classes=True),
         dict(mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True)),
 "rel_bias": (dict(score_mod="score + rel[h, q_idx - kv_idx + N - 1]", mask_mod="q_idx >= kv_idx", hi=CAUSAL_HI, block_classes=True, aux=(Param("rel", ("Hq", "R"), Dtype.F32, Role.AUX),)),
              dict(score_mod="score + rel[h, q_idx - kv_idx + N - 1]", mask_mod="q_idx >= kv_idx", m_lo=SLIDE, block_classes=True, aux=(Param("rel", ("Hq", "R"), Dtype.F32, Role.AUX),), aux_grads=(("drel", "rel"),))),
}
fwd_designs = {"sm90": {128: (Design(128, 128, 8, 3),)}}
# the best backward designs measured on H200 (bench/results/BWD_LOWERING_NOTES.md), per program form
bwd_designs = {"sm90": {128: (Design(64, 128, 8, 2, tma=False),)}}
dqpass_designs = {"sm90": {128: (Design(64, 64, 4, 2, tma=False),)}}
sched = Schedule(block_m=64, block_n=64, num_warps=4, num_stages=2)
DQ_HI = {"causal": "minimum(N, m_start + BLOCK_M)", "gqa": "minimum(N, m_start + BLOCK_M)", "alibi": "minimum(N, m_start + BLOCK_M)",
         "softcap": "minimum(N, m_start + BLOCK_M)", "rel_bias": "minimum(N, m_start + BLOCK_M)", "document": "minimum(N, m_start + BLOCK_M)",
         "sliding_window": "minimum(N, m_start + BLOCK_M)", "plain": "N"}
DQ_LO = {"sliding_window": f"maximum(0, (m_start - {W - 1}) // BLOCK_N * BLOCK_N)"}
for name, (fk, bk) in V.items():
    f = forward(f"{name}_fwd", dtype=Dtype.BF16, schedule=sched, **fk)
    b = backward(f"{name}_bwd", dtype=Dtype.BF16, schedule=sched, **bk)
    (OUT / f"mod_{name}.py").write_text(lower_autograd(f, b, fwd_designs=fwd_designs, bwd_designs=bwd_designs))
    b2 = backward(f"{name}_bwd", dtype=Dtype.BF16, schedule=sched, dq_pass=(DQ_LO.get(name, "0"), DQ_HI[name]), **bk)
    (OUT / f"mod_{name}+dqpass.py").write_text(lower_autograd(f, b2, fwd_designs=fwd_designs, bwd_designs=dqpass_designs))
print("ok", sorted(V))
