"""A BERT sentence encoder in plain torch: the default embedding model without sentence-transformers.

`sentence-transformers` imports `transformers`, scikit-learn and `torch._dynamo` (about 5 s of a 7 s
`kb query` on 2 cores) to run what, for all-MiniLM-L6-v2, is six BERT layers, mean pooling and an L2
normalisation. `BertEncoder` runs exactly that from the model directory's own files: `tokenizer.json`
through `tokenizers`, the weights through `safetensors`, the layers in torch (eval mode: no dropout).
Its vectors equal sentence-transformers' to 1e-6 (tests/test_embed.py compares them).

`is_mean_pooled_bert(path)` says whether a directory is a model this module runs: a BERT checkpoint in
safetensors whose sentence-transformers pipeline is Transformer -> mean Pooling [-> Normalize].
"""

from __future__ import annotations

import json
import math
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


class BertEncoder:
    """Mean-pooled BERT sentence vectors (L2-normalised when the pipeline normalises), on the CPU."""

    def __init__(self, path: Path) -> None:
        import torch
        from safetensors.torch import load_file
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
        self.w = {k[len(prefix):]: v.float() for k, v in weights.items() if k.startswith(prefix)}
        self._torch = torch

    def _ln(self, x: Any, name: str) -> Any:
        return self._torch.nn.functional.layer_norm(x, x.shape[-1:], self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                                                    self.eps)

    def _linear(self, x: Any, name: str) -> Any:
        return self._torch.nn.functional.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def encode(self, texts: Sequence[str]) -> Any:
        """A float32 tensor [len(texts), hidden]: one vector per text."""
        torch, F = self._torch, self._torch.nn.functional
        encodings = self.tokenizer.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in encodings])
        types = torch.tensor([e.type_ids for e in encodings])
        keep = torch.tensor([e.attention_mask for e in encodings], dtype=torch.float32)
        with torch.inference_mode():
            pos = torch.arange(ids.shape[1])
            x = (self.w["embeddings.word_embeddings.weight"][ids] + self.w["embeddings.position_embeddings.weight"][pos]
                 + self.w["embeddings.token_type_embeddings.weight"][types])
            x = self._ln(x, "embeddings.LayerNorm")
            n, t, h = x.shape
            d = h // self.heads
            bias = ((1.0 - keep) * torch.finfo(torch.float32).min)[:, None, None, :]  # padded keys get no weight
            for i in range(self.layers):
                layer = f"encoder.layer.{i}"

                def heads(name: str) -> Any:
                    return self._linear(x, f"{layer}.attention.self.{name}").view(n, t, self.heads, d).transpose(1, 2)

                q, k, v = heads("query"), heads("key"), heads("value")
                probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1)
                ctx = (probs @ v).transpose(1, 2).reshape(n, t, h)
                x = self._ln(self._linear(ctx, f"{layer}.attention.output.dense") + x, f"{layer}.attention.output.LayerNorm")
                inner = F.gelu(self._linear(x, f"{layer}.intermediate.dense"))
                x = self._ln(self._linear(inner, f"{layer}.output.dense") + x, f"{layer}.output.LayerNorm")
            pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1e-9)
            return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled
