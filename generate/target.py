"""The transfer target of a spec: variant slots, aux params, dtype, whether v has a head dim of its own."""

from __future__ import annotations

from generate.spec import Spec
from generate.transfer import Target
from kb.ir.expr import Expr, ExprOp, loaded_tensors, walk
from kb.ir.nodes import Dtype, Param, Role

__all__ = ["target_for", "SPEC_DTYPES"]

SPEC_DTYPES = {"fp32": Dtype.F32, "bf16": Dtype.BF16, "fp16": Dtype.F16}
_TORCH_TO_IR = {"torch.float32": Dtype.F32, "torch.bfloat16": Dtype.BF16, "torch.float16": Dtype.F16,
                "torch.int32": Dtype.I32, "torch.int64": Dtype.I64, "torch.bool": Dtype.BOOL}
_INDEX_DIM = {"b": "B", "h": "Hq", "q_idx": "M", "kv_idx": "N"}


def _index_dims(exprs: list[Expr], tensor: str, rank: int) -> list[set[str]]:
    """Per position of `tensor`, the dim names its index expressions imply (b -> B, q_idx -> M, ...)."""
    dims: list[set[str]] = [set() for _ in range(rank)]
    for e in exprs:
        for node in walk(e):
            if node.op is ExprOp.LOAD and node.value == tensor:
                for i, ix in enumerate(node.args[:rank]):
                    name = _INDEX_DIM.get(str(ix.value)) if ix.op is ExprOp.VAR else None
                    dims[i].add(name or "?")
    return dims


def _aux_param(name: str, t, exprs: list[Expr], self_attention: bool) -> Param:
    """Symbolic where the index says which dim a position runs over (doc_ids[b, q_idx] -> [B, M]), else concrete."""
    implied = _index_dims(exprs, name, t.dim())
    # a position indexed by both q_idx and kv_idx (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) runs over N
    # when the spec is self-attention (M == N); otherwise it stays concrete
    implied = [{"N"} if d == {"M", "N"} and self_attention else d for d in implied]
    # any other position (a table indexed by q_idx - kv_idx + c, a constant index) gets a dim of its own,
    # bound from the tensor at run time, so the kernel serves tables of any length (the IR's load rule
    # reads 0 out of range, as the spec's tensor would raise; the interpreter check covers the spec's shape)
    shape = tuple(next(iter(d)) if len(d) == 1 and "?" not in d else f"{name}_n{i}"
                  for i, (d, n) in enumerate(zip(implied, t.shape)))
    return Param(name, shape, _TORCH_TO_IR.get(str(t.dtype), Dtype.F32), Role.AUX)


def target_for(spec: Spec) -> Target:
    exprs = [e for e in (spec.score_mod, spec.mask_mod, spec.sink) if e is not None]  # the sink: serving transfer
    used: set[str] = set()
    for e in exprs:
        used |= loaded_tensors(e)
    aux = tuple(_aux_param(n, spec.aux[n], exprs, spec.shapes.M == spec.shapes.N) for n in sorted(used) if n in spec.aux)
    return Target(score_mod=spec.score_mod, mask_mod=spec.mask_mod, dtype=SPEC_DTYPES[spec.shapes.dtype],
                  out_dtype=SPEC_DTYPES[spec.output_dtype], aux=aux,
                  dims=(spec.shapes.M, spec.shapes.N), value_dim=spec.shapes.value_dim)
