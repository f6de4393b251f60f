"""Write measured generated-kernel timings from a bench JSON into a KB as `measured` PerfRecords.

A record is written only for a generated-kernel measurement with status ok whose program content
hash (kb.ir.text.content_hash of the program that was run, stored in the JSON) equals some KB
kernel's `content_hash`; everything else is skipped (logged). Writing the same JSON twice yields
the same rows (ids are content hashes of the measurement).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

from kb.errors import KBError
from kb.store.models import Kernel, PerfRecord

__all__ = ["record_results"]

log = logging.getLogger(__name__)


def record_results(kb, json_path: Path | str) -> int:
    """Record every matching measurement of `json_path` into `kb` (a KnowledgeBase); returns how many."""
    path = Path(json_path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KBError(f"cannot read bench results {path}: {err}") from err
    if doc.get("schema") != "kernel-kb/bench/v1":
        raise KBError(f"{path} is not a kernel-kb bench JSON (schema {doc.get('schema')!r}); produce it with kb bench")
    perf: list[PerfRecord] = []
    for r in doc["records"]:
        if not r["impl"].startswith("generated") or r["impl"].startswith("generated-") or r["status"] != "ok":
            continue
        kernels = kb.list(Kernel, content_hash=r.get("content_hash") or "")
        if not kernels:
            log.info("no KB kernel with content hash %s (%s, %s): skipped", r.get("content_hash"), r["case"], r["impl"])
            continue
        shape = {**r["shape"], "impl": r["impl"], "schedule": r.get("schedule")}
        perf.append(PerfRecord(kernel_id=kernels[0].id, kind="measured", gpu=r["gpu"], driver=r["driver"],
                               torch_version=r["torch_version"], triton_version=r["triton_version"],
                               shape_json=json.dumps(shape, sort_keys=True), dtype=r["dtype"], ms=r["ms"],
                               tflops=r["tflops"], command=r["command"],
                               measured_at=dt.datetime.fromisoformat(r["date"]),
                               notes=f"kb bench suite {doc.get('suite')}; {r['case']}; peak {doc['peak_bf16_tflops']:.0f}"))
    if perf:
        kb.write_perf(perf)
    return len(perf)
