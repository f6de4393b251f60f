"""Learnable parameters and buffers of a spec stay run-time inputs of the generated kernel.

ModelNew holds the spec Model's state under the same keys, so `load_state_dict(Model.state_dict())`
works, and a new value (a trained temperature, a trained bias table) gives the Model's outputs.
The specs start from random (temperature) or zero (bias table) values, so a kernel with the
generation-time values baked in fails here."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # ModelNew runs in this process; set before triton is imported

import pytest
import torch

from generate.pipeline import GenerateOptions, generate
from tests.support.repo import REPO

pytestmark = pytest.mark.network  # the session KB ingests the real flash-attn release

SPECS = REPO / "tests" / "data" / "specs_state"
QUICK = dict(verify_distributions=("normal",), verify_max_cases=1, compile_cuda=False, max_attempts=3, backward=False)


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _trained(key: str, value: torch.Tensor) -> torch.Tensor:
    """A value far from the initial one, as training would leave it."""
    g = torch.Generator().manual_seed(7)
    return torch.tensor(1.3) if value.dim() == 0 else torch.randn(value.shape, generator=g) * 0.8


# (spec, its learnable state_dict key); t5_bucket_bias reads an nn.Embedding table at log-spaced buckets
# (torch.log, then a float -> int64 cast: the IR's trunc)
LEARNABLE = [(SPECS / "learnable_temperature.py", "t"), (SPECS / "learnable_rel_bias.py", "attn.rel_bias"),
             (REPO / "tests" / "data" / "specs" / "t5_bucket_bias.py", "rel.weight")]


@pytest.mark.parametrize("spec_path,learnable", LEARNABLE, ids=lambda x: x.stem if isinstance(x, Path) else x)
def test_learnable_state_stays_learnable(ingested_kb, tmp_path: Path, spec_path: Path, learnable: str) -> None:
    name = spec_path.stem
    r = generate(ingested_kb, spec_path, GenerateOptions(out_dir=tmp_path / "out", **QUICK))
    assert r.succeeded, r.error
    user = _import(spec_path, f"user_{name}")
    cand = _import(r.files["candidate"], f"cand_{name}")
    model = user.Model(*user.get_init_inputs()).eval()
    new = cand.ModelNew(*user.get_init_inputs())
    # the same state, under the same keys, parameters as parameters
    assert set(new.state_dict()) == set(model.state_dict())
    assert {n for n, _ in new.named_parameters()} == {n for n, _ in model.named_parameters()} == {learnable}
    q, k, v = user.get_inputs()
    with torch.no_grad():
        before = model(q, k, v)
        model.get_parameter(learnable).copy_(_trained(learnable, model.get_parameter(learnable)))
        ref = model(q, k, v)
    assert (ref - before).abs().max() > 0.05, "the new value must change the output"
    new.load_state_dict(model.state_dict())  # strict: every key matches
    with torch.no_grad():
        out = new(q, k, v)
    assert out.dtype == ref.dtype and torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_baked_mask_buffer_refuses_a_different_value(ingested_kb, tmp_path: Path) -> None:
    """The causal mask buffer becomes `kv_idx <= q_idx` in the kernel: loading another mask is an error, not ignored."""
    spec_path = SPECS / "learnable_rel_bias.py"
    r = generate(ingested_kb, spec_path, GenerateOptions(out_dir=tmp_path / "out", verify_kernel=False, **{
        k: v for k, v in QUICK.items() if not k.startswith("verify")}))
    assert r.succeeded, r.error
    user = _import(spec_path, "user_baked")
    cand = _import(r.files["candidate"], "cand_baked")
    state = user.Model(*user.get_init_inputs()).state_dict()
    new = cand.ModelNew(*user.get_init_inputs())
    new.load_state_dict(state)  # the same mask: fine
    state["attn.causal"] = torch.ones_like(state["attn.causal"])
    with pytest.raises(RuntimeError, match=r"attn\.causal"):
        new.load_state_dict(state)
