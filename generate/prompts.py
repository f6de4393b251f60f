"""Prompt construction for the LLM transfer engine (generate.llm).

A conversation is one system message (the role, the IR grammar, the semantic rules a transfer
must respect) and one user message (target spec, reference IR, snippets, lessons, the answer
format); each failed attempt appends the model's answer and a feedback message.

Invariants:
- `GRAMMAR` is the grammar block of docs/ir.md verbatim (tests/test_generate_llm_engine.py checks it), so
  the model reads the grammar the parser implements.
- Every prompt asks for exactly one ```kbir fenced block holding the whole program; that is the
  format `generate.llm.extract_ir` reads.
- Prompts are bounded: at most `MAX_SNIPPETS` snippets, `MAX_LESSONS` lessons, and spec source
  truncated to `MAX_SOURCE_CHARS`, so a large KB never blows the context.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    # the messages openai's client takes; at run time a plain dict, so that the rule engine never imports openai
    from openai.types.chat import ChatCompletionMessageParam as Message

    from generate.spec import Spec
else:
    Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}

__all__ = [
    "GRAMMAR", "SYSTEM_PROMPT", "MAX_SNIPPETS", "MAX_LESSONS", "MAX_SOURCE_CHARS", "Message",
    "SnippetLike", "spec_summary", "snippet_text", "user_prompt", "feedback_prompt", "initial_messages",
]

MAX_SNIPPETS = 6
MAX_LESSONS = 8
MAX_SOURCE_CHARS = 3000
MAX_FEEDBACK_CHARS = 2000

GRAMMAR = """\
program     := "program" NAME NL param* schedule variant* kernel+
param       := "param" NAME ":" "[" dims "]" DTYPE ROLE NL          # dims: NAME | INT, comma separated; [] for scalars
schedule    := "schedule" (KEY "=" VALUE)* NL                       # block_m block_n num_warps num_stages head_pad kv_order num_splits warp_specialize
variant     := "score_mod(score, b, h, q_idx, kv_idx) =" EXPR NL
             | "mask_mod(b, h, q_idx, kv_idx) =" EXPR NL
kernel      := "kernel" NAME "grid(" axis ("," axis)* "):" NL block   # axis := NAME ":" EXPR
block       := INDENT stmt+ DEDENT
stmt        := "let" NAME "=" EXPR
             | "load" NAME "=" NAME "[" index ("," index)* "]" ["other" FLOAT]
             | "store" NAME "[" index ("," index)* "]" ("=" | "+=") NAME      # += accumulates (f32 targets)
             | "init" NAME "=" "full(" dims ";" (FLOAT | EXPR) ")" DTYPE       # EXPR: a scalar, e.g. sinks[h]
             | "dot" NAME "=" (NAME | "trans(" NAME ")") "@" (NAME | "trans(" NAME ")")
             | "elementwise" NAME "=" EXPR
             | "reduce" NAME "=" ("max"|"sum") "(" NAME "," INT ")"
             | "score_mod" NAME "at" "(" EXPR "," ["heads"] EXPR "," EXPR "," EXPR ")"
             | "mask" NAME "at" "(" EXPR "," ["heads"] EXPR "," EXPR "," EXPR ")" ("mask_mod" | "bounds")
             | "online_softmax" "(" NAME "," NAME "," NAME ")" "+=" NAME "@" NAME
             | "finalize" NAME "," NAME "=" "(" NAME "," NAME "," NAME ")"
             | "combine" NAME "," NAME "=" "(" NAME "," NAME ")"
             | "probs" NAME "=" "exp(" NAME "-" NAME ")"                     # backward, see below
             | "softmax_grad" NAME "=" NAME "*" "(" NAME "-" NAME ")"
             | "score_mod_grad" NAME "wrt" NAME "at" "(" EXPR "," EXPR "," EXPR "," EXPR ")"
             | "aux_grad" NAME "of" NAME "+=" NAME "wrt" NAME ["centred" "on" NAME] "at" "(" EXPR "," EXPR "," EXPR "," EXPR ")"
             | "for" NAME "in" "range(" EXPR "," EXPR "," DIM ")" ("forward"|"reverse") ":" NL block
             | "if" "block(" EXPR "," EXPR "," EXPR "," EXPR ")" "is" ["not"] ("full"|"partial"|"empty") ":" NL block ["else:" NL block]
index       := EXPR | EXPR ":+" DIM ["until" EXPR] | ":"
             | "[" EXPR "for" NAME "in" "range(" DIM ")" ["if" EXPR] "]"   # a gathered axis
DTYPE       := f32 | bf16 | f16 | i32 | i64 | bool
ROLE        := in | out | aux | scalar | scratch
EXPR        := a Python expression (see kb/ir/expr.py): + - * / // % << >> < <= > >= == != & | ~,
               where exp exp2 log tanh sigmoid erf abs sqrt maximum minimum cdiv trunc, tensor[i, j], inf
"""

_RULES = """\
Semantics you must respect:
- Blocks are indented by two spaces per level. Shapes: q [B, Hq, M, D], k/v [B, Hkv, N, D],
  o [B, Hq, M, D], lse [B, Hq, M] f32 (natural log). GQA head mapping: hk = h // (Hq // Hkv).
- `//` and `%` are floor division and modulo. Expressions may use grid axes, lets, loop
  variables, dims, scalar params and BLOCK_M, BLOCK_N, NUM_SPLITS, HEAD_PAD.
- score_mod/mask_mod bodies see only their own parameters, dims, scalar params and aux tensors
  (loaded as name[i]); every aux tensor and extra scalar needs its own `param` line.
- `score_mod s at (b, h, q_start, kv_start)` applies score_mod to the scaled scores of the tile
  whose first query/key indices are q_start/kv_start; `mask s at (...) mask_mod` then sets
  scores where mask_mod is false to -inf and always masks kv_idx >= N. Fully masked rows give
  o = 0 and lse = -inf. `if block(...) is full|partial|empty` classes a tile by mask_mod.
- KV-loop bounds may skip a block only when mask_mod is false for every element of it; when in
  doubt, loop over the full range [0, N) and let the mask decide.
- Every out param must be stored. Block sizes are powers of two."""

SYSTEM_PROMPT = f"""\
You transfer expert GPU attention kernels written in kbir, a tile-level IR, to new attention \
variants. You read a verified reference program and a target spec and write the target program \
in kbir. Keep the reference's structure and schedule; change only what the target needs.

kbir grammar:
{GRAMMAR}
{_RULES}

Answer with the complete program in exactly one ```kbir fenced block. Text outside the block \
is ignored."""


class SnippetLike(Protocol):
    """What a snippet needs for a prompt (retrieve.hybrid.RankedSnippet has these)."""

    @property
    def kind(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def ir_text(self) -> str: ...

    @property
    def where(self) -> str: ...


def _fenced(lang: str, text: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + f"\n... [{len(text) - limit} more characters cut]"


def spec_summary(spec: "Spec", *, max_source_chars: int = MAX_SOURCE_CHARS) -> str:
    """The target as the model needs it: variant slots, shapes, scale, aux tensors, features, source."""
    sh = spec.shapes
    lines = [f"spec file: {Path(spec.path).name}"]
    variants = spec.variants_text()
    lines.append("variant slots (write these into the program):")
    lines.append("\n".join("  " + v for v in variants.splitlines()) if variants else "  none (plain attention)")
    lines.append(f"shapes: B={sh.B} Hq={sh.Hq} Hkv={sh.Hkv} M={sh.M} N={sh.N} D={sh.D}; "
                 f"dtype {sh.dtype} (IR: {_ir_dtype(sh.dtype)})")
    if sh.value_dim:
        lines.append(f"value head dim: Dv={sh.Dv} (v [B, Hkv, N, Dv], o [B, Hq, M, Dv] and split-KV o partials end in Dv; "
                     "the accumulator is [BLOCK_M, HEAD_PAD_V])")
    lines.append("softmax scale: " + ("1/sqrt(D), passed as scalar sm_scale" if spec.scale is None
                                      else f"{spec.scale!r}, passed as scalar sm_scale"))
    if spec.aux:
        lines.append("aux tensors the variant slots load (dims may be symbolic when they follow the shapes):")
        for n, t in spec.aux.items():
            dims = ", ".join(str(d) for d in t.shape)
            lines.append(f"  param {n}: [{dims}] {_TORCH_TO_IR.get(str(t.dtype), str(t.dtype))} aux")
    lines.append(f"features: {spec.features.describe()}")
    try:
        source = Path(spec.path).read_text()
    except OSError:
        source = ""
    if source:
        lines.append("torch reference (the spec's own code):")
        lines.append(_fenced("python", _clip(source, max_source_chars)))
    return "\n".join(lines)


_TORCH_TO_IR = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16", "torch.int32": "i32",
                "torch.int64": "i64", "torch.bool": "bool"}


def _ir_dtype(dtype: str) -> str:
    return {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}.get(dtype, dtype)


def snippet_text(s: SnippetLike) -> str:
    """One snippet: kind, title, provenance and its IR meaning."""
    head = f"[{s.kind}] {s.title}".rstrip() + (f" (from {s.where})" if s.where else "")
    return f"{head}\n{_fenced('kbir', s.ir_text)}" if s.ir_text.strip() else head


def user_prompt(spec_summary: str, reference_ir: str, snippets: Sequence[str], lessons: Sequence[str],
                feedback: str | None = None) -> str:
    """The first user message; `feedback` (for a one-shot retry without history) is appended."""
    parts = [
        "Transfer the reference program to the target spec.",
        "# Target spec\n" + spec_summary.strip(),
        "# Reference program (verified against its own torch reference)\n" + _fenced("kbir", reference_ir),
    ]
    if snippets:
        parts.append("# Relevant regions of expert kernels (IR meaning, provenance)\n"
                     + "\n\n".join(s.strip() for s in snippets[:MAX_SNIPPETS]))
    if lessons:
        parts.append("# Lessons from earlier transfers\n" + "\n".join(f"- {ln.strip()}" for ln in lessons[:MAX_LESSONS]))
    parts.append("# Answer\nWrite the whole target program in one ```kbir block: the target's variant slots, "
                 "params for its aux tensors and scalars, KV-loop bounds and block tests that are correct for "
                 "its mask, and the reference's schedule, loads and softmax structure otherwise.")
    if feedback:
        parts.append(feedback_prompt(feedback))
    return "\n\n".join(parts)


def feedback_prompt(error: str) -> str:
    """The message sent after a failed attempt: the failure, then the instruction to answer again."""
    return ("Your previous program failed:\n" + _fenced("text", _clip(error.strip(), MAX_FEEDBACK_CHARS))
            + "\nFix it and answer with the whole corrected program in one ```kbir block.")


def initial_messages(spec_summary: str, reference_ir: str, snippets: Sequence[str], lessons: Sequence[str],
                     feedback: str | None = None) -> list[Message]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_prompt(spec_summary, reference_ir, snippets, lessons, feedback)},
    ]
