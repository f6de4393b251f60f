"""The persistent knowledge base: SQL rows are the truth, Chroma holds their embeddings.

    from kb.settings import load_settings
    from kb.store import open_kb, Kernel
    with open_kb(load_settings()) as kb:
        kid = kb.write_kernel(Kernel(name="fa2_fwd", ir_text=text, arch="sm80"))
        kb.vector_query("kernels", "causal softcap bf16", k=5)
"""

from kb.store.doctor import DoctorReport, Drift, DriftKind
from kb.store.kb import Counts, KernelBundle, KnowledgeBase, open_kb
from kb.store.models import (
    SCHEMA_VERSION,
    TABLES,
    Attempt,
    GenerationRun,
    Kernel,
    Lesson,
    Origin,
    PerfKind,
    PerfRecord,
    RunStatus,
    Snippet,
    Source,
    SourceKind,
    Tunable,
)
from kb.store.vectors import COLLECTIONS

__all__ = [
    "open_kb",
    "KnowledgeBase",
    "KernelBundle",
    "Counts",
    "DoctorReport",
    "Drift",
    "DriftKind",
    "SCHEMA_VERSION",
    "TABLES",
    "COLLECTIONS",
    "Source",
    "SourceKind",
    "Kernel",
    "Origin",
    "Snippet",
    "Tunable",
    "PerfRecord",
    "PerfKind",
    "GenerationRun",
    "RunStatus",
    "Attempt",
    "Lesson",
]
