"""Synthetic records for store tests, a writer process for crash/concurrency tests, and `edit_export`
(what a hand editing an export, or an older tool, produces: the footer recomputed to match).

    python -m tests.support.store HOME START COUNT [--kill-at-upsert N]

writes kernels START..START+COUNT-1 one `write_kernel` at a time and prints
`committed <kernel id>` after each returns; `--kill-at-upsert N` SIGKILLs itself
at the N-th Chroma upsert, i.e. after that kernel's SQL commit, before its embedding.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import text

from kb.features import Features
from kb.settings import load_settings
from kb.store import (
    Attempt,
    GenerationRun,
    Kernel,
    KnowledgeBase,
    Lesson,
    PerfRecord,
    Snippet,
    Source,
    Tunable,
    open_kb,
)
from kb.store.vectors import VectorStore

SNIPPETS_PER_KERNEL = 3
MASKS = ("causal", "sliding_window", "none", "document")
ARCHS = ("sm80", "sm90", "sm100")


def make_source() -> Source:
    return Source(distribution="synthetic-attn", version="1.0", kind="local", filename="synthetic", sha256="0" * 64)


def make_kernel(i: int, source_id: str | None = None) -> Kernel:
    mask = MASKS[i % len(MASKS)]
    feats = Features(mask=mask, causal=mask == "causal", head_dim=(64, 128)[i % 2], arch=ARCHS[i % 3])
    ir = (
        f"program attn_{i}(q: [B, H, M, {feats.head_dim}] bf16, k: [B, H, N, {feats.head_dim}] bf16)\n"
        f"  for kv in blocks(0, N, 64):\n    s = dot(q, k[kv])\n    mask_mod = {mask}\n    online_softmax(s)\n"
    )
    return Kernel(
        name=f"attn_{i}", family=("fa2", "fa3", "flex")[i % 3], ir_text=ir, features_json=feats.to_json(),
        arch=feats.arch, dtype="bf16", head_dim=feats.head_dim, source_id=source_id, file=f"k{i}.py",
        line_start=1, line_end=5, lifter_version="t1",
    )


def make_snippets(i: int, source_id: str | None = None) -> list[Snippet]:
    return [
        Snippet(kind=kind, title=f"{kind} of kernel {i}", ir_text=f"{kind}_expr_{i}", text=f"// {kind} region {i}",
                source_id=source_id, file=f"k{i}.py", line_start=j + 1, line_end=j + 2)
        for j, kind in enumerate(("mask", "softmax_rescale", "epilogue")[:SNIPPETS_PER_KERNEL])
    ]


def make_tunable(i: int, source_id: str | None = None) -> Tunable:
    return Tunable(source_id=source_id, family="fa2", arch="sm80", head_dim=64 * (i % 2 + 1), dtype="bf16",
                   params_json=f'{{"BLOCK_M": 128, "BLOCK_N": {32 * (i % 3 + 1)}}}', condition="is_causal", file="t.h",
                   line_start=10, line_end=12)


def make_measured(kernel_id: str) -> PerfRecord:
    return PerfRecord(kernel_id=kernel_id, kind="measured", gpu="NVIDIA H200", driver="570.1", torch_version="2.13",
                      triton_version="3.6", shape_json='{"B": 1, "H": 8, "S": 4096, "D": 128}', dtype="bf16", ms=1.5,
                      tflops=400.0, command="kb bench", measured_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))


def make_reported(kernel_id: str) -> PerfRecord:
    return PerfRecord(kernel_id=kernel_id, kind="reported", tflops=335.0, dtype="bf16", citation="FlashAttention-2 paper, fig. 6")


def make_run_records(kernel_id: str) -> tuple[GenerationRun, Attempt, Lesson]:
    run = GenerationRun(spec_path="specs/alibi.py", spec_hash="abc", engine="rule", memory=True, status="succeeded",
                        kernel_id=kernel_id, finished_at=datetime(2026, 1, 2, tzinfo=UTC))
    run.id = "r-00000000000000aa"
    attempt = Attempt(run_id=run.id, n=1, reference_id=kernel_id, ir_text="program x", verdict="passed", feedback="", duration_s=0.5)
    lesson = Lesson(run_id=run.id, kind="fix", text="ALiBi slopes must be loaded per head, not per block")
    return run, attempt, lesson


def edit_export(path: Path, edit: Callable[[list[dict]], list[dict]]) -> Path:
    """Rewrite the records of export `path` with `edit` (a list of {"table", "data"} in, the new list out) and
    give it a footer that matches, as a deliberate edit would; returns `path`."""
    lines = path.read_text().splitlines()
    records = edit([json.loads(line) for line in lines[1:-1]])
    body = [json.dumps(r, sort_keys=True) for r in records]
    tables: dict[str, int] = {}
    for r in records:
        tables[r["table"]] = tables.get(r["table"], 0) + 1
    footer = {"records": len(body), "tables": tables,
              "sha256": hashlib.sha256("".join(line + "\n" for line in body).encode()).hexdigest()}
    path.write_text("\n".join([lines[0], *body, json.dumps({"table": "kb_footer", "data": footer})]) + "\n")
    return path


def export_without_snippets(kb: KnowledgeBase, path: Path) -> None:
    """`kb.export_jsonl(path)` of `kb` (a private copy: its snippet rows are deleted) without its snippets. Embedding
    is what an import spends its time on (the corpus's 285 snippets take most of ~25 s on 2 cores): tests whose
    import is not about snippets import this instead."""
    with kb.engines.write.begin() as con:
        con.execute(text("DELETE FROM snippets"))
    kb.export_jsonl(path)


def _main(argv: list[str]) -> None:
    home, start, count = argv[0], int(argv[1]), int(argv[2])
    if "--kill-at-upsert" in argv:
        kill_at = int(argv[argv.index("--kill-at-upsert") + 1])
        calls = {"n": 0}
        real = VectorStore.upsert

        def upsert(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, *a, **kw)

        VectorStore.upsert = upsert  # type: ignore[method-assign]
    with open_kb(load_settings(home=home)) as kb:
        src = kb.write_source(make_source())
        print("ready", flush=True)
        for i in range(start, start + count):
            kid = kb.write_kernel(make_kernel(i, src), snippets=make_snippets(i, src), tunables=[make_tunable(i, src)])
            print("committed", kid, flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
