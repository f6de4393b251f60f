"""A BERT sentence encoder in numpy: the default embedding model without sentence-transformers.

`sentence-transformers` imports `transformers`, scikit-learn and `torch._dynamo` (about 5 s of a 7 s
`kb query` on 2 cores) to run what, for all-MiniLM-L6-v2, is six BERT layers, mean pooling and an L2
normalisation. `BertEncoder` runs exactly that from the model directory's own files: `tokenizer.json`
through `tokenizers`, the weights through `safetensors`, the layers in numpy (inference: no dropout).
Its vectors equal sentence-transformers' to 1e-6 (tests/test_embed.py compares them).

`is_mean_pooled_bert(path)` says whether a directory is a model this module runs: a BERT checkpoint in
safetensors whose sentence-transformers pipeline is Transformer -> mean Pooling [-> Normalize].
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BertEncoder", "is_mean_pooled_bert"]

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def is_mean_pooled_bert(path: Path) -> bool:
    """True when `path` is a sentence-transformers directory this encoder reproduces (see module docstring)."""
    try:
        config = _json(path / "config.json")
        modules = _json(path / "modules.json")
        types = [m["type"] for m in modules]
        if types not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]):
            return False
        pooling = _json(path / modules[1]["path"] / "config.json")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
    return (config.get("model_type") == "bert" and config.get("hidden_act") == "gelu"
            and config.get("position_embedding_type", "absolute") == "absolute"
            and modes == {"pooling_mode_mean_tokens"}
            and (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file())


class _NumpyOps:
    """The array operations the encoder needs, in numpy (+ scipy's erf): no torch import, for a handful of texts."""

    def __init__(self) -> None:
        import numpy as np
        from scipy.special import erf

        self.np, self.erf = np, erf

    def array(self, data: Any, float_: bool = False) -> Any:
        return self.np.asarray(data, dtype=self.np.float32 if float_ else self.np.int64)

    def weight(self, w: Any) -> Any:
        return w

    def contiguous(self, x: Any) -> Any:  # numpy's stacked matmul calls BLAS only on contiguous operands
        return self.np.ascontiguousarray(x)

    def layer_norm(self, x: Any, w: Any, b: Any, eps: float) -> Any:
        centred = x - x.mean(-1, keepdims=True)
        var = (centred * centred).mean(-1, keepdims=True)
        return centred / self.np.sqrt(var + self.np.float32(eps)) * w + b

    def softmax(self, x: Any) -> Any:
        e = self.np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def gelu(self, x: Any) -> Any:
        f = self.np.float32
        return f(0.5) * x * (f(1.0) + self.erf(x * f(1.0 / math.sqrt(2.0))))


class _TorchOps(_NumpyOps):
    """The same operations in torch: several times faster on batches (ingest), about 1.2 s more to import."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def array(self, data: Any, float_: bool = False) -> Any:
        return self.torch.tensor(data, dtype=self.torch.float32 if float_ else self.torch.int64)

    def weight(self, w: Any) -> Any:
        return self.torch.from_numpy(w)

    def contiguous(self, x: Any) -> Any:
        return x.contiguous()

    def layer_norm(self, x: Any, w: Any, b: Any, eps: float) -> Any:
        return self.torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)

    def softmax(self, x: Any) -> Any:
        return self.torch.softmax(x, dim=-1)

    def gelu(self, x: Any) -> Any:
        return self.torch.nn.functional.gelu(x)


SMALL_BATCH = 8  # texts up to which numpy encodes when torch is not loaded yet


class BertEncoder:
    """Mean-pooled BERT sentence vectors (L2-normalised when the pipeline normalises), on the CPU.

    One forward pass over two array libraries: numpy for a few texts while torch is not imported (a `kb query` for
    free text then never imports it: about 1.2 s of a cold start on 2 cores), torch otherwise (batches: several
    times faster). Both compute in float32, like the checkpoint, and agree to 1e-6."""

    def __init__(self, path: Path) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        config = _json(path / "config.json")
        st_config = _json(path / "sentence_bert_config.json") if (path / "sentence_bert_config.json").is_file() else {}
        self.normalize = _NORMALIZE in [m["type"] for m in _json(path / "modules.json")]
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config["layer_norm_eps"])
        max_len = min(int(st_config.get("max_seq_length", config["max_position_embeddings"])),
                      int(config["max_position_embeddings"]))
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_len)
        self.tokenizer.enable_padding(pad_id=int(config.get("pad_token_id", 0)))
        weights = load_file(str(path / "model.safetensors"))
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""
        self.w = {k[len(prefix):]: v.astype("float32") for k, v in weights.items() if k.startswith(prefix)}
        self._ops: dict[str, _NumpyOps] = {}

    def ops(self, backend: str) -> _NumpyOps:
        if backend not in self._ops:
            self._ops[backend] = _TorchOps() if backend == "torch" else _NumpyOps()
        return self._ops[backend]

    def encode(self, texts: Sequence[str], backend: str | None = None) -> list[list[float]]:
        """One vector per text; `backend` "numpy" or "torch" (None: see the class docstring)."""
        if backend is None:
            backend = "numpy" if len(texts) <= SMALL_BATCH and "torch" not in sys.modules else "torch"
        xp = self.ops(backend)
        if backend == "torch":
            with xp.torch.inference_mode():  # type: ignore[attr-defined]
                return self._forward(xp, texts).tolist()
        return self._forward(xp, texts).tolist()

    def _forward(self, xp: _NumpyOps, texts: Sequence[str]) -> Any:
        def w(name: str) -> Any:
            return xp.weight(self.w[name])

        def linear(x: Any, name: str) -> Any:
            return x @ w(f"{name}.weight").T + w(f"{name}.bias")

        def norm(x: Any, name: str) -> Any:
            return xp.layer_norm(x, w(f"{name}.weight"), w(f"{name}.bias"), self.eps)

        encodings = self.tokenizer.encode_batch(list(texts))
        ids = xp.array([e.ids for e in encodings])
        types = xp.array([e.type_ids for e in encodings])
        keep = xp.array([e.attention_mask for e in encodings], float_=True)
        n, t = len(encodings), len(encodings[0].ids)
        x = (w("embeddings.word_embeddings.weight")[ids] + w("embeddings.position_embeddings.weight")[:t]
             + w("embeddings.token_type_embeddings.weight")[types])
        x = norm(x, "embeddings.LayerNorm")
        h = x.shape[-1]
        d = h // self.heads
        bias = ((1.0 - keep) * -3.4028234663852886e38)[:, None, None, :]  # float32's lowest: padded keys get no weight
        for i in range(self.layers):
            layer = f"encoder.layer.{i}"

            def heads(name: str) -> Any:  # [n, heads, t, d]
                return xp.contiguous(linear(x, f"{layer}.attention.self.{name}").reshape(n, t, self.heads, d)
                                     .swapaxes(1, 2))

            q, k, v = heads("query"), heads("key"), heads("value")
            probs = xp.softmax(q @ xp.contiguous(k.swapaxes(2, 3)) * (1.0 / math.sqrt(d)) + bias)
            ctx = (probs @ v).swapaxes(1, 2).reshape(n, t, h)
            x = norm(linear(ctx, f"{layer}.attention.output.dense") + x, f"{layer}.attention.output.LayerNorm")
            x = norm(linear(xp.gelu(linear(x, f"{layer}.intermediate.dense")), f"{layer}.output.dense") + x,
                     f"{layer}.output.LayerNorm")
        pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1)[:, None].clip(1e-9)
        if self.normalize:
            pooled = pooled / ((pooled * pooled).sum(1)[:, None] ** 0.5).clip(1e-12)
        return pooled
