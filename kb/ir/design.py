"""Designs: everything about a kernel that is not its meaning, chosen per target GPU.

A `Design` is the part of a schedule that the emitted module may pick at launch (tile sizes,
warps, pipeline stages, split-KV count, whether Hopper's TMA path is used, whether the query
heads sharing a KV head are packed into one tile's rows: GQA packing), so one lowered
module serves many designs. The code shape (which loops exist, block skipping, masks) comes
from the IR and the lowering, never from the design. A `DesignTable` maps a target arch and a
head-dim bucket to designs ordered best first.

Text form: `128x64 w4 s3` plus ` split8` (or ` split-auto`), ` notma`, ` pack`, ` dqswap` and ` qsplit` when they differ
from the defaults; `parse_design(str(d)) == d`.

A design is valid or does not exist: construction checks types (ints are ints, `tma` and `pack_gqa`
bools) and ranges (`DESIGN_RULES`), and `Design.from_dict` (what the KB stores) also refuses unknown or
missing keys, so a record written by hand or an older kernel-kb cannot reach a lowering.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from collections.abc import Mapping

from kb.errors import KBError
from kb.ir.algebra import is_pow2, next_pow2
from kb.ir.nodes import DOT_MIN_K, Program, Schedule

__all__ = ["AUTO_SPLITS", "Design", "DesignTable", "head_bucket", "parse_design", "arch_of_capability",
           "SHARED_MEMORY_BYTES"]

AUTO_SPLITS = 0  # num_splits chosen at launch from the grid size and the SM count (flash-decoding)
# shared memory a block may opt in to, per arch (CUDA programming guide, compute capabilities table)
SHARED_MEMORY_BYTES = {"sm80": 163 * 1024, "sm86": 99 * 1024, "sm89": 99 * 1024, "sm90": 227 * 1024,
                       "sm100": 227 * 1024, "sm120": 99 * 1024}
MAX_SPLITS = 1024  # split-KV programs per (batch, head, query block); more is never useful
DESIGN_RULES = "blocks are powers of two in [16, 256], warps a power of two <= 16, stages in [1, 8], " \
               f"num_splits in [0, {MAX_SPLITS}] (0 = chosen at launch), tma, pack_gqa, dq_swap and q_split true or false"
_TEXT = re.compile(r"(\d+)x(\d+) w(\d+) s(\d+)((?: split(?:\d+|-auto))?)((?: notma)?)((?: pack)?)((?: dqswap)?)((?: qsplit)?)")


@dataclass(frozen=True, order=True)
class Design:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1  # AUTO_SPLITS: chosen at launch
    tma: bool = True  # use tensor descriptors (TMA) where the GPU and layouts allow
    # GQA packing (kb.lower.pack_gqa): tile rows are (query head in group, query position) pairs, so one
    # program reads its KV head's K/V once for all Hq // Hkv query heads; ignored where the program cannot pack
    pack_gqa: bool = False
    # backward only: its Q-outer kernels that recompute P (a separate dq pass) run block_n query rows against block_m
    # keys per step, the transpose of the KV-outer dK/dV kernel's tile (the Triton tutorial's BLOCK_M2 = BLOCK_N1,
    # BLOCK_N2 = BLOCK_M1); ignored by forwards and by backwards with a block table or no such kernel
    dq_swap: bool = False
    # backward only: the KV-outer dK/dV kernel's query loop split by block class in closed form (partial, full blocks
    # without a branch, partial), so Triton pipelines its q/dO loads; ignored where the loop cannot be split
    q_split: bool = False

    def __post_init__(self) -> None:
        ints = ("block_m", "block_n", "num_warps", "num_stages", "num_splits")
        typed = all(type(getattr(self, f)) is int for f in ints) \
            and all(type(getattr(self, f)) is bool for f in ("tma", "pack_gqa", "dq_swap", "q_split"))
        if not typed or not (all(is_pow2(getattr(self, f)) for f in ("block_m", "block_n", "num_warps"))
                             and 16 <= self.block_m <= 256 and 16 <= self.block_n <= 256 and self.num_warps <= 16
                             and 1 <= self.num_stages <= 8 and 0 <= self.num_splits <= MAX_SPLITS):
            raise KBError(f"invalid design {self!r}: {DESIGN_RULES}")

    def __str__(self) -> str:
        split = "" if self.num_splits == 1 else (" split-auto" if self.num_splits == AUTO_SPLITS else f" split{self.num_splits}")
        return (f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}{split}{'' if self.tma else ' notma'}"
                f"{' pack' if self.pack_gqa else ''}{' dqswap' if self.dq_swap else ''}{' qsplit' if self.q_split else ''}")

    def as_tuple(self) -> tuple:
        """(BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps, num_stages, tma, pack_gqa), then dq_swap and q_split when either
        is set: the launch parameters in an emitted module (whose runtime reads the last two only in a backward)."""
        t = (self.block_m, self.block_n, self.num_splits, self.num_warps, self.num_stages, self.tma, self.pack_gqa)
        if self.q_split:
            return (*t, self.dq_swap, True)
        return (*t, True) if self.dq_swap else t

    @classmethod
    def from_tuple(cls, t: tuple) -> Design:
        """The inverse of `as_tuple` (an emitted module's launch parameters); a 6-tuple (before GQA packing) packs nothing."""
        bm, bn, splits, warps, stages, tma, *rest = t
        return cls(bm, bn, warps, stages, splits, bool(tma), bool(rest and rest[0]), bool(rest[1:] and rest[1]),
                   bool(rest[2:] and rest[2]))

    def to_dict(self) -> dict[str, int | bool]:
        """The stored form; `dq_swap` and `q_split` only when set, so records of designs without them read as they
        always did."""
        d = dataclasses.asdict(self)
        for flag in ("dq_swap", "q_split"):
            if not d[flag]:
                del d[flag]
        return d

    @classmethod
    def from_dict(cls, d: object) -> Design:
        """The design `to_dict` wrote; `KBError` for anything else (not an object, unknown or missing keys, bad values)."""
        if not isinstance(d, Mapping):
            raise KBError(f"not a design: {d!r} is not an object")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown, missing = sorted(set(d) - set(names)), [n for n in names[:4] if n not in d]
        if unknown or missing:
            raise KBError(f"not a design: {dict(d)}" + (f"; unknown keys {unknown}" if unknown else "")
                          + (f"; missing {missing}" if missing else ""))
        return cls(**{n: d[n] for n in names if n in d})

    @classmethod
    def of_schedule(cls, s: Schedule, tma: bool = True, pack_gqa: bool = False) -> Design:
        return cls(s.block_m, s.block_n, s.num_warps, s.num_stages, s.num_splits, tma, pack_gqa)

    def apply(self, p: Program) -> Program:
        """`p` with this design's schedule (the IR's meaning is unchanged)."""
        s = dataclasses.replace(p.schedule, block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps,
                                num_stages=self.num_stages, num_splits=max(1, self.num_splits))
        return dataclasses.replace(p, schedule=s)

    def shared_bytes(self, head_dim: int, elem_bytes: int = 2, head_dim_v: int | None = None) -> int:
        """A lower bound on the shared memory of a forward attention tile loop: the Q tile plus
        `num_stages` buffered K and V tiles, V's as wide as the value head dim (`head_dim_v`, default
        `head_dim`). Triton may need more; a launch that fails tries the next design."""
        pad, pad_v = head_bucket(head_dim), head_bucket(head_dim if head_dim_v is None else head_dim_v)
        return elem_bytes * (pad * (self.block_m + self.num_stages * self.block_n) + pad_v * self.num_stages * self.block_n)

    def fits(self, arch: str, head_dim: int, elem_bytes: int = 2, head_dim_v: int | None = None) -> bool:
        return self.shared_bytes(head_dim, elem_bytes, head_dim_v) <= SHARED_MEMORY_BYTES.get(arch, 99 * 1024)


def parse_design(text: str) -> Design:
    m = _TEXT.fullmatch(text.strip())
    if m is None:
        raise KBError(f"not a design: {text!r}; write e.g. '128x64 w4 s3', '16x64 w4 s3 split-auto notma pack'")
    split = m.group(5).strip()
    splits = 1 if not split else (AUTO_SPLITS if split == "split-auto" else int(split[5:]))
    return Design(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), splits, not m.group(6), bool(m.group(7)),
                  bool(m.group(8)), bool(m.group(9)))


def head_bucket(head_dim: int) -> int:
    """The padded head dim a design is chosen for: the next power of two >= D, at least 16."""
    return max(DOT_MIN_K, next_pow2(head_dim))


def arch_of_capability(capability: tuple[int, int]) -> str:
    """`torch.cuda.get_device_capability()` as an arch name: (9, 0) -> "sm90"."""
    major, minor = capability
    return f"sm{major}{minor}"


# {arch: {head-dim bucket: designs best first}}
DesignTable = Mapping[str, Mapping[int, tuple[Design, ...]]]
