"""The text form of a Program: canonical printer, parser and content hash.

The grammar is docs/ir.md's. Invariants:
- `parse_program(print_program(p)) == p` for every program the validator accepts.
- Printing is canonical: fixed keyword order and spacing, no comments, floats in `repr`
  form (`-inf`, `0.0`), `other` omitted when 0.0, score_mod printed before mask_mod.
- `content_hash(p)` is the sha256 hex digest of the printed text, so two programs have the
  same identity exactly when they print the same.
- Every parse error is a `KBError` whose message starts with `line L, column C:` (1-based).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, fields
from enum import Enum
from typing import TypeVar

from kb.errors import KBError
from kb.ir.expr import Expr, parse_expr, print_expr
from kb.ir.nodes import (
    AuxGrad, BlockClass, Combine, Dim, Dot, Dtype, Elementwise, Finalize, For, Full, Gather, GridAxis, IfBlock,
    Index, Init, Kernel, Let, Load, Mask, OnlineSoftmax, Param, Probs, Program, Reduce, Role, Schedule,
    ScoreMod, ScoreModGrad, SoftmaxGrad, Span, Stmt, StmtOp, Store, TileAt, VariantFn,
)
from kb.ir.visit import StmtVisitor

__all__ = ["print_program", "parse_program", "content_hash", "print_stmt_header", "print_block", "INDENT"]

INDENT = "  "  # one block level

E = TypeVar("E", bound=Enum)

# ================================================================ printing


def _float(x: float) -> str:
    x = float(x)
    if math.isnan(x):
        raise KBError("NaN is not allowed in IR constants; use a finite value or -inf")
    return repr(x)  # repr gives 'inf' / '-inf' and round-trips every finite float


def _dim(d: Dim) -> str:
    return str(d)


def _dims(ds: tuple[Dim, ...]) -> str:
    return ", ".join(_dim(d) for d in ds)


def _index(ix: Index) -> str:
    if isinstance(ix, Full):
        return ":"
    if isinstance(ix, Span):
        until = "" if ix.until is None else f" until {print_expr(ix.until)}"
        return f"{print_expr(ix.start)}:+{_dim(ix.size)}{until}"
    if isinstance(ix, Gather):
        valid = "" if ix.valid is None else f" if {print_expr(ix.valid)}"
        return f"[{print_expr(ix.index)} for {ix.var} in range({_dim(ix.size)}){valid}]"
    return print_expr(ix)


def _indices(ixs: tuple[Index, ...]) -> str:
    return ", ".join(_index(i) for i in ixs)


def _at(at: TileAt) -> str:
    parts = [print_expr(e) for e in at]
    if at.head_rows:
        parts[1] = f"{_HEAD_ROWS}{parts[1]}"
    return ", ".join(parts)


class _Header(StmtVisitor[str]):
    """Each statement's own line (for `for`/`if`, the header without the body)."""

    def s_let(self, st: Let) -> str:
        return f"let {st.name} = {print_expr(st.value)}"

    def s_load(self, st: Load) -> str:
        other = "" if st.other == 0.0 else f" other {_float(st.other)}"
        return f"load {st.out} = {st.tensor}[{_indices(st.index)}]{other}"

    def s_store(self, st: Store) -> str:
        return f"store {st.tensor}[{_indices(st.index)}] {'+=' if st.accumulate else '='} {st.value}"

    def s_init(self, st: Init) -> str:
        fill = print_expr(st.fill) if isinstance(st.fill, Expr) else _float(st.fill)
        return f"init {st.out} = full({_dims(st.shape)}; {fill}) {st.dtype.value}"

    def s_dot(self, st: Dot) -> str:
        a = f"trans({st.a})" if st.trans_a else st.a
        b = f"trans({st.b})" if st.trans_b else st.b
        return f"dot {st.out} = {a} @ {b}"

    def s_elementwise(self, st: Elementwise) -> str:
        return f"elementwise {st.out} = {print_expr(st.value)}"

    def s_reduce(self, st: Reduce) -> str:
        return f"reduce {st.out} = {st.kind}({st.src}, {st.axis})"

    def s_scoremod(self, st: ScoreMod) -> str:
        return f"score_mod {st.tile} at ({_at(st.at)})"

    def s_mask(self, st: Mask) -> str:
        return f"mask {st.tile} at ({_at(st.at)}) {'mask_mod' if st.use_mask_mod else 'bounds'}"

    def s_onlinesoftmax(self, st: OnlineSoftmax) -> str:
        return f"online_softmax ({st.m}, {st.l}, {st.acc}) += {st.scores} @ {st.values}"

    def s_finalize(self, st: Finalize) -> str:
        return f"finalize {st.o}, {st.lse} = ({st.m}, {st.l}, {st.acc})"

    def s_combine(self, st: Combine) -> str:
        return f"combine {st.o}, {st.lse} = ({st.o_parts}, {st.lse_parts})"

    def s_probs(self, st: Probs) -> str:
        return f"probs {st.out} = exp({st.scores} - {st.lse})"

    def s_softmaxgrad(self, st: SoftmaxGrad) -> str:
        return f"softmax_grad {st.out} = {st.p} * ({st.dp} - {st.delta})"

    def s_scoremodgrad(self, st: ScoreModGrad) -> str:
        return f"score_mod_grad {st.tile} wrt {st.scores} at ({_at(st.at)})"

    def s_auxgrad(self, st: AuxGrad) -> str:
        centred = f" centred on {st.lse}" if st.lse is not None else ""
        return f"aux_grad {st.grad} of {st.aux} += {st.tile} wrt {st.scores}{centred} at ({_at(st.at)})"

    def s_for(self, st: For) -> str:
        return f"for {st.var} in range({print_expr(st.lo)}, {print_expr(st.hi)}, {_dim(st.step)}) {st.order}:"

    def s_ifblock(self, st: IfBlock) -> str:
        neg = "not " if st.negate else ""
        return f"if block({_at(st.at)}) is {neg}{st.cls.value}:"


_HEADER = _Header()


def print_stmt_header(st: Stmt) -> str:
    """The statement's own line (for `for`/`if`, the header without the body)."""
    return _HEADER.visit(st)


def print_block(stmts: tuple[Stmt, ...], depth: int, out: list[str]) -> None:
    """Append the text of `stmts`, nested blocks included, at block depth `depth` to `out`."""
    pad = INDENT * depth
    for st in stmts:
        out.append(pad + print_stmt_header(st))
        if isinstance(st, For):
            print_block(st.body, depth + 1, out)
        elif isinstance(st, IfBlock):
            print_block(st.then, depth + 1, out)
            if st.orelse:
                out.append(pad + "else:")
                print_block(st.orelse, depth + 1, out)


def _schedule(s: Schedule) -> str:
    return "schedule " + " ".join(f"{f.name}={getattr(s, f.name)}" for f in fields(Schedule))


def print_program(p: Program) -> str:
    """Canonical text of `p` (ends with a newline)."""
    out = [f"program {p.name}"]
    for prm in p.params:
        out.append(f"param {prm.name}: [{_dims(prm.shape)}] {prm.dtype.value} {prm.role.value}")
    out.append(_schedule(p.schedule))
    for fn in (p.score_mod, p.mask_mod):
        if fn is not None:
            out.append(f"{fn.kind}({', '.join(fn.params)}) = {print_expr(fn.body)}")
    for k in p.kernels:
        axes = ", ".join(f"{a.name}: {print_expr(a.extent)}" for a in k.grid)
        out.append(f"kernel {k.name} grid({axes}):")
        print_block(k.body, 1, out)
    return "\n".join(out) + "\n"


def content_hash(p: Program) -> str:
    """sha256 hex of the canonical text: the program's identity in the KB."""
    return hashlib.sha256(print_program(p).encode("utf-8")).hexdigest()


# ================================================================ parsing

_NAME = r"[A-Za-z_]\w*"
_NAME_RE = re.compile(rf"^{_NAME}$")
_INT_RE = re.compile(r"^-?\d+$")


@dataclass(frozen=True)
class _Line:
    no: int  # 1-based line number
    indent: int  # leading spaces
    text: str  # without indentation, comment and trailing blanks

    @property
    def col(self) -> int:
        return self.indent + 1


def _fail(line: int, col: int, msg: str) -> KBError:
    return KBError(f"line {line}, column {col}: {msg}")


def _lines(text: str) -> list[_Line]:
    out: list[_Line] = []
    for no, raw in enumerate(text.splitlines(), start=1):
        body = raw.split("#", 1)[0].rstrip()
        if not body.strip():
            continue
        stripped = body.lstrip(" ")
        indent = len(body) - len(stripped)
        if stripped[0] == "\t" or "\t" in body[:indent + 1]:
            raise _fail(no, indent + 1, "tab in indentation; indent with two spaces per block level")
        if indent % len(INDENT):
            raise _fail(no, indent + 1, f"indentation of {indent} spaces; use two spaces per block level")
        out.append(_Line(no, indent, stripped))
    return out


class _Cursor:
    """A position in the list of significant lines."""

    def __init__(self, lines: list[_Line]) -> None:
        self.lines = lines
        self.pos = 0

    def peek(self) -> _Line | None:
        return self.lines[self.pos] if self.pos < len(self.lines) else None

    def take(self) -> _Line:
        ln = self.lines[self.pos]
        self.pos += 1
        return ln


def _piece(text: str, col: int) -> tuple[str, int]:
    """Strip `text`, moving `col` past the leading blanks."""
    lead = len(text) - len(text.lstrip())
    return text.strip(), col + lead


def _split_top(text: str, col: int, sep: str, line: int) -> list[tuple[str, int]]:
    """Split at `sep` outside brackets; each piece stripped, with its column."""
    pieces: list[tuple[str, int]] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise _fail(line, col + i, f"unbalanced {ch!r}")
        elif ch == sep and depth == 0:
            pieces.append(_piece(text[start:i], col + start))
            start = i + 1
    if depth:
        raise _fail(line, col + len(text), "unclosed bracket")
    pieces.append(_piece(text[start:], col + start))
    if len(pieces) == 1 and not pieces[0][0]:
        return []
    for piece, c in pieces:
        if not piece:
            raise _fail(line, c, f"empty item in {sep!r}-separated list")
    return pieces


def _expr(text: str, line: int, col: int) -> Expr:
    text, col = _piece(text, col)
    if not text:
        raise _fail(line, col, "missing expression")
    return parse_expr(text, line=line, col=col)


def _name(text: str, line: int, col: int, what: str = "name") -> str:
    text, col = _piece(text, col)
    if not _NAME_RE.match(text):
        raise _fail(line, col, f"expected a {what} (identifier), got {text!r}")
    return text


def _parse_dim(text: str, line: int, col: int) -> Dim:
    text, col = _piece(text, col)
    if _INT_RE.match(text):
        return int(text)
    if _NAME_RE.match(text):
        return text
    raise _fail(line, col, f"expected a dim (name or integer), got {text!r}")


def _parse_dims(text: str, line: int, col: int) -> tuple[Dim, ...]:
    return tuple(_parse_dim(p, line, c) for p, c in _split_top(text, col, ",", line))


def _parse_float(text: str, line: int, col: int) -> float:
    text, col = _piece(text, col)
    try:
        value = float(text)
    except ValueError:
        raise _fail(line, col, f"expected a number (e.g. 0.0, -inf), got {text!r}") from None
    if math.isnan(value):
        raise _fail(line, col, "NaN is not allowed; use a finite value or -inf")
    return value


def _parse_fill(text: str, line: int, col: int) -> float | Expr:
    """An init's fill: a number (`-inf`, `0.0`), else a scalar expression (`sinks[h]`)."""
    try:
        float(_piece(text, col)[0])
    except ValueError:
        return _expr(text, line, col)
    return _parse_float(text, line, col)


def _enum(cls: type[E], text: str, line: int, col: int, what: str) -> E:
    try:
        return cls(text)
    except ValueError:
        known = ", ".join(m.value for m in cls)
        raise _fail(line, col, f"unknown {what} {text!r}; known: {known}") from None


_GATHER_RE = re.compile(r"^\[(?P<index>.+?)\s+for\s+(?P<var>\S+)\s+in\s+range\((?P<size>[^()]*)\)(?:\s+if\s+(?P<valid>.+))?\]$")
_UNTIL_RE = re.compile(r"^(?P<size>\S+)\s+until\s+(?P<until>.+)$")


def _parse_gather(text: str, line: int, col: int) -> Gather:
    m = _GATHER_RE.match(text)
    if m is None:
        raise _fail(line, col, "bad gathered index; use [EXPR for VAR in range(SIZE)] or [EXPR for VAR in range(SIZE) if COND]")
    valid = None if m["valid"] is None else _expr(m["valid"], line, col + m.start("valid"))
    return Gather(_name(m["var"], line, col + m.start("var"), "lane variable"),
                  _parse_dim(m["size"], line, col + m.start("size")),
                  _expr(m["index"], line, col + m.start("index")), valid)


def _parse_span(start: str, rest: str, line: int, col: int, rest_col: int) -> Span:
    """`start:+rest` where rest is `SIZE` or `SIZE until END`."""
    m = _UNTIL_RE.match(rest.strip())
    if m is None:
        return Span(_expr(start, line, col), _parse_dim(rest, line, rest_col))
    lead = len(rest) - len(rest.lstrip())
    return Span(_expr(start, line, col), _parse_dim(m["size"], line, rest_col + lead),
                _expr(m["until"], line, rest_col + lead + m.start("until")))


def _parse_index(text: str, line: int, col: int) -> Index:
    if text == ":":
        return Full()
    if text.startswith("[") and text.endswith("]"):
        return _parse_gather(text, line, col)
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == ":" and depth == 0:
            if text[i + 1:i + 2] != "+":
                raise _fail(line, col + i, "bad index; use EXPR, EXPR:+SIZE [until END], [EXPR for VAR in range(SIZE) if COND] or ':'")
            return _parse_span(text[:i], text[i + 2:], line, col, col + i + 2)
    return _expr(text, line, col)


def _parse_indices(text: str, line: int, col: int) -> tuple[Index, ...]:
    items = _split_top(text, col, ",", line)
    if not items:
        raise _fail(line, col, "empty index; a tensor needs one index per dim")
    return tuple(_parse_index(p, line, c) for p, c in items)


_HEAD_ROWS = "heads "  # `at (b, heads h0, q, kv)`: the tile's rows are the query heads h0, h0 + 1, ...


def _parse_at(m: re.Match, group: str, line: int, col0: int) -> TileAt:
    parts = _split_top(m.group(group), col0 + m.start(group), ",", line)
    if len(parts) != 4:
        raise _fail(line, col0 + m.start(group), f"expected 4 coordinates (b, h, q_start, kv_start), got {len(parts)}")
    head, col = parts[1]  # pieces come stripped
    head_rows = head.startswith(_HEAD_ROWS)
    if head_rows:
        parts[1] = (head[len(_HEAD_ROWS):], col + len(_HEAD_ROWS))
    b, h, q_start, kv_start = (_expr(p, line, c) for p, c in parts)
    return TileAt(b, h, q_start, kv_start, head_rows)


# ---------------------------------------------------------------- statements

_N = rf"({_NAME})"
_STMT_RE: dict[str, re.Pattern] = {
    "let": re.compile(rf"^let\s+(?P<name>{_NAME})\s*=(?P<value>.+)$"),
    "load": re.compile(rf"^load\s+(?P<out>{_NAME})\s*=\s*(?P<tensor>{_NAME})\[(?P<index>.*)\](?:\s+other\s+(?P<other>\S+))?$"),
    "store": re.compile(rf"^store\s+(?P<tensor>{_NAME})\[(?P<index>.*)\]\s*(?P<acc>\+?)=\s*(?P<value>{_NAME})$"),
    "init": re.compile(rf"^init\s+(?P<out>{_NAME})\s*=\s*full\((?P<dims>[^;()]*);(?P<fill>[^;]*)\)\s+(?P<dtype>\w+)$"),
    "dot": re.compile(rf"^dot\s+(?P<out>{_NAME})\s*=\s*(?:trans\(\s*(?P<ta>{_NAME})\s*\)|(?P<a>{_NAME}))\s*@\s*(?:trans\(\s*(?P<bt>{_NAME})\s*\)|(?P<b>{_NAME}))$"),
    "elementwise": re.compile(rf"^elementwise\s+(?P<out>{_NAME})\s*=(?P<value>.+)$"),
    "reduce": re.compile(rf"^reduce\s+(?P<out>{_NAME})\s*=\s*(?P<kind>max|sum)\(\s*(?P<src>{_NAME})\s*,\s*(?P<axis>-?\d+)\s*\)$"),
    "score_mod": re.compile(rf"^score_mod\s+(?P<tile>{_NAME})\s+at\s+\((?P<at>.*)\)$"),
    "mask": re.compile(rf"^mask\s+(?P<tile>{_NAME})\s+at\s+\((?P<at>.*)\)\s+(?P<which>mask_mod|bounds)$"),
    "online_softmax": re.compile(rf"^online_softmax\s+\(\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*\)\s*\+=\s*{_N}\s*@\s*{_N}$"),
    "finalize": re.compile(rf"^finalize\s+{_N}\s*,\s*{_N}\s*=\s*\(\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*\)$"),
    "combine": re.compile(rf"^combine\s+{_N}\s*,\s*{_N}\s*=\s*\(\s*{_N}\s*,\s*{_N}\s*\)$"),
    "probs": re.compile(rf"^probs\s+{_N}\s*=\s*exp\(\s*{_N}\s*-\s*{_N}\s*\)$"),
    "softmax_grad": re.compile(rf"^softmax_grad\s+{_N}\s*=\s*{_N}\s*\*\s*\(\s*{_N}\s*-\s*{_N}\s*\)$"),
    "score_mod_grad": re.compile(rf"^score_mod_grad\s+(?P<tile>{_NAME})\s+wrt\s+(?P<scores>{_NAME})\s+at\s+\((?P<at>.*)\)$"),
    "aux_grad": re.compile(rf"^aux_grad\s+(?P<grad>{_NAME})\s+of\s+(?P<aux>{_NAME})\s*\+=\s*(?P<tile>{_NAME})\s+wrt\s+(?P<scores>{_NAME})(?:\s+centred\s+on\s+(?P<lse>{_NAME}))?\s+at\s+\((?P<at>.*)\)$"),
    "for": re.compile(rf"^for\s+(?P<var>{_NAME})\s+in\s+range\((?P<args>.*)\)\s+(?P<order>forward|reverse)\s*:$"),
    "if": re.compile(r"^if\s+block\((?P<at>.*)\)\s+is\s+(?P<neg>not\s+)?(?P<cls>full|partial|empty)\s*:$"),
}
_STMT_FORM = {
    "let": "let NAME = EXPR",
    "load": "load NAME = TENSOR[index, ...] [other FLOAT]",
    "store": "store TENSOR[index, ...] = NAME  or  store TENSOR[index, ...] += NAME",
    "init": "init NAME = full(DIM, ...; FLOAT or EXPR) DTYPE",
    "dot": "dot NAME = A @ B, A @ trans(B), trans(A) @ B or trans(A) @ trans(B)",
    "elementwise": "elementwise NAME = EXPR",
    "reduce": "reduce NAME = max(SRC, AXIS)  or  sum(SRC, AXIS)",
    "score_mod": "score_mod TILE at (b, h, q_start, kv_start)",
    "mask": "mask TILE at (b, h, q_start, kv_start) mask_mod|bounds",
    "online_softmax": "online_softmax (m, l, acc) += SCORES @ VALUES",
    "finalize": "finalize O, LSE = (m, l, acc)",
    "combine": "combine O, LSE = (O_PARTS, LSE_PARTS)",
    "probs": "probs P = exp(SCORES - LSE)",
    "softmax_grad": "softmax_grad DS = P * (DP - DELTA)",
    "score_mod_grad": "score_mod_grad DS wrt SCORES at (b, h, q_start, kv_start)",
    "aux_grad": "aux_grad GRAD of AUX += DS wrt SCORES [centred on LSE] at (b, h, q_start, kv_start)",
    "for": "for VAR in range(LO, HI, STEP) forward|reverse:",
    "if": "if block(b, h, q_start, kv_start) is [not] full|partial|empty:",
}


# the parser dispatches on the statement's keyword (its `StmtOp` value), before any node exists
assert set(_STMT_RE) == set(_STMT_FORM) == {op.value for op in StmtOp}, "one pattern and form per StmtOp"


def _simple_stmt(kw: str, m: re.Match, ln: _Line) -> Stmt:
    L = ln.no
    match kw:
        case "let":
            return Let(m["name"], _expr(m["value"], L, ln.col + m.start("value")))
        case "load":
            idx = _parse_indices(m["index"], L, ln.col + m.start("index"))
            other = 0.0 if m["other"] is None else _parse_float(m["other"], L, ln.col + m.start("other"))
            return Load(m["out"], m["tensor"], idx, other)
        case "store":
            idx = _parse_indices(m["index"], L, ln.col + m.start("index"))
            return Store(m["tensor"], idx, m["value"], accumulate=m["acc"] == "+")
        case "init":
            shape = _parse_dims(m["dims"], L, ln.col + m.start("dims"))
            fill = _parse_fill(m["fill"], L, ln.col + m.start("fill"))
            return Init(m["out"], shape, fill, _enum(Dtype, m["dtype"], L, ln.col + m.start("dtype"), "dtype"))
        case "dot":
            return Dot(m["out"], m["ta"] or m["a"], m["bt"] or m["b"], trans_b=m["bt"] is not None, trans_a=m["ta"] is not None)
        case "elementwise":
            return Elementwise(m["out"], _expr(m["value"], L, ln.col + m.start("value")))
        case "reduce":
            return Reduce(m["out"], m["kind"], m["src"], int(m["axis"]))
        case "score_mod":
            return ScoreMod(m["tile"], _parse_at(m, "at", L, ln.col))
        case "mask":
            return Mask(m["tile"], _parse_at(m, "at", L, ln.col), use_mask_mod=m["which"] == "mask_mod")
        case "online_softmax":
            return OnlineSoftmax(*m.groups())
        case "finalize":
            return Finalize(*m.groups())
        case "combine":
            return Combine(*m.groups())
        case "probs":
            return Probs(*m.groups())
        case "softmax_grad":
            return SoftmaxGrad(*m.groups())
        case "score_mod_grad":
            return ScoreModGrad(m["tile"], m["scores"], _parse_at(m, "at", L, ln.col))
        case "aux_grad":
            return AuxGrad(m["grad"], m["aux"], m["tile"], m["scores"], _parse_at(m, "at", L, ln.col), m["lse"])
    raise AssertionError(kw)


def _parse_block(cur: _Cursor, indent: int, opener: _Line) -> tuple[Stmt, ...]:
    first = cur.peek()
    if first is None or first.indent <= opener.indent:
        at = first or opener
        raise _fail(at.no, at.col, f"expected an indented block after line {opener.no}")
    stmts: list[Stmt] = []
    while (ln := cur.peek()) is not None and ln.indent >= indent:
        if ln.indent > indent:
            raise _fail(ln.no, ln.col, f"unexpected indentation ({ln.indent} spaces, expected {indent})")
        stmts.append(_parse_stmt(cur, indent))
    return tuple(stmts)


def _parse_stmt(cur: _Cursor, indent: int) -> Stmt:
    ln = cur.take()
    kw_m = re.match(r"\w+", ln.text)
    kw = kw_m.group(0) if kw_m else ln.text[:1]
    if kw == "else":
        raise _fail(ln.no, ln.col, "'else:' without a matching 'if block(...)' at the same indentation")
    if kw not in _STMT_RE:
        raise _fail(ln.no, ln.col, f"unknown statement {kw!r}; known: {', '.join(_STMT_RE)}")
    m = _STMT_RE[kw].match(ln.text)
    if m is None:
        raise _fail(ln.no, ln.col, f"malformed {kw} statement; expected: {_STMT_FORM[kw]}")
    if kw == "for":
        args = _split_top(m["args"], ln.col + m.start("args"), ",", ln.no)
        if len(args) != 3:
            raise _fail(ln.no, ln.col + m.start("args"), f"range() takes (lo, hi, step), got {len(args)} arguments")
        (lo, lc), (hi, hc), (step, sc) = args
        body = _parse_block(cur, indent + len(INDENT), ln)
        return For(m["var"], _expr(lo, ln.no, lc), _expr(hi, ln.no, hc), _parse_dim(step, ln.no, sc), m["order"], body)
    if kw == "if":
        at = _parse_at(m, "at", ln.no, ln.col)
        then = _parse_block(cur, indent + len(INDENT), ln)
        orelse: tuple[Stmt, ...] = ()
        nxt = cur.peek()
        if nxt is not None and nxt.indent == indent and re.match(r"^else\s*:$", nxt.text):
            cur.take()
            orelse = _parse_block(cur, indent + len(INDENT), nxt)
        return IfBlock(BlockClass(m["cls"]), m["neg"] is not None, at, then=then, orelse=orelse)
    return _simple_stmt(kw, m, ln)


# ---------------------------------------------------------------- program header

_PROGRAM_RE = re.compile(rf"^program\s+(?P<name>{_NAME})$")
_PARAM_RE = re.compile(rf"^param\s+(?P<name>{_NAME})\s*:\s*\[(?P<dims>[^\]]*)\]\s+(?P<dtype>\w+)\s+(?P<role>\w+)$")
_VARIANT_RE = re.compile(r"^(?P<kind>score_mod|mask_mod)\((?P<params>[^()]*)\)\s*=(?P<body>.+)$")
_KERNEL_RE = re.compile(rf"^kernel\s+(?P<name>{_NAME})\s+grid\((?P<axes>.*)\)\s*:$")
_SCHEDULE_FIELDS = {f.name: f for f in fields(Schedule)}


def _parse_param(ln: _Line) -> Param:
    m = _PARAM_RE.match(ln.text)
    if m is None:
        raise _fail(ln.no, ln.col, "malformed param; expected: param NAME: [DIM, ...] DTYPE ROLE")
    return Param(
        m["name"],
        _parse_dims(m["dims"], ln.no, ln.col + m.start("dims")),
        _enum(Dtype, m["dtype"], ln.no, ln.col + m.start("dtype"), "dtype"),
        _enum(Role, m["role"], ln.no, ln.col + m.start("role"), "role"),
    )


def _schedule_value(key: str, text: str, line: int, col: int) -> int | bool | str:
    kind = Schedule.__dataclass_fields__[key].type
    if kind == "bool":
        if text not in ("True", "False"):
            raise _fail(line, col, f"{key} takes True or False, got {text!r}")
        return text == "True"
    if kind == "int":
        if not _INT_RE.match(text):
            raise _fail(line, col, f"{key} takes an integer, got {text!r}")
        return int(text)
    if key == "kv_order" and text not in ("forward", "reverse"):
        raise _fail(line, col, f"kv_order takes forward or reverse, got {text!r}")
    return text


def _parse_schedule(ln: _Line) -> Schedule:
    values: dict[str, int | bool | str] = {}
    for tok in re.finditer(r"\S+", ln.text[len("schedule"):]):
        col = ln.col + len("schedule") + tok.start()
        key, eq, text = tok.group(0).partition("=")
        if not eq:
            raise _fail(ln.no, col, f"expected KEY=VALUE, got {tok.group(0)!r}")
        if key not in _SCHEDULE_FIELDS:
            raise _fail(ln.no, col, f"unknown schedule key {key!r}; known: {', '.join(_SCHEDULE_FIELDS)}")
        if key in values:
            raise _fail(ln.no, col, f"schedule key {key!r} given twice")
        values[key] = _schedule_value(key, text, ln.no, col + len(key) + 1)
    return Schedule(**values)  # type: ignore[arg-type]


def _parse_variant(ln: _Line) -> VariantFn:
    m = _VARIANT_RE.match(ln.text)
    if m is None:
        raise _fail(ln.no, ln.col, "malformed variant; expected: score_mod(score, b, h, q_idx, kv_idx) = EXPR")
    params = tuple(_name(p, ln.no, c, "parameter") for p, c in _split_top(m["params"], ln.col + m.start("params"), ",", ln.no))
    return VariantFn(m["kind"], params, _expr(m["body"], ln.no, ln.col + m.start("body")))


def _parse_kernel(cur: _Cursor) -> Kernel:
    ln = cur.take()
    m = _KERNEL_RE.match(ln.text)
    if m is None:
        raise _fail(ln.no, ln.col, "malformed kernel; expected: kernel NAME grid(AXIS: EXPR, ...):")
    axes: list[GridAxis] = []
    for piece, col in _split_top(m["axes"], ln.col + m.start("axes"), ",", ln.no):
        name, colon, extent = piece.partition(":")
        if not colon:
            raise _fail(ln.no, col, f"grid axis needs NAME: EXTENT, got {piece!r}")
        axes.append(GridAxis(_name(name, ln.no, col, "grid axis name"), _expr(extent, ln.no, col + len(name) + 1)))
    if not axes:
        raise _fail(ln.no, ln.col + m.start("axes"), "a kernel grid needs at least one axis")
    return Kernel(m["name"], tuple(axes), _parse_block(cur, len(INDENT), ln))


def parse_program(text: str) -> Program:
    """Parse the text form (comments and blank lines allowed); errors carry line and column."""
    cur = _Cursor(_lines(text))
    first = cur.peek()
    if first is None:
        raise KBError("line 1, column 1: empty program; expected 'program NAME'")
    head = _PROGRAM_RE.match(first.text)
    if head is None or first.indent:
        raise _fail(first.no, first.col, "expected 'program NAME' as the first line")
    cur.take()
    params: list[Param] = []
    schedule: Schedule | None = None
    variants: dict[str, VariantFn] = {}
    kernels: list[Kernel] = []
    # sections in grammar order: param* schedule variant* kernel+
    order = {"param": 0, "schedule": 1, "score_mod": 2, "mask_mod": 2, "kernel": 3}
    stage = 0
    while (ln := cur.peek()) is not None:
        if ln.indent:
            raise _fail(ln.no, ln.col, "unexpected indentation; statements belong inside a kernel")
        kw_m = re.match(r"\w+", ln.text)
        kw = kw_m.group(0) if kw_m else ln.text[:1]
        if kw not in order:
            raise _fail(ln.no, ln.col, f"unknown top-level line {kw!r}; expected one of: param, schedule, score_mod, mask_mod, kernel")
        if order[kw] < stage or (kw == "schedule" and schedule is not None):
            raise _fail(ln.no, ln.col, f"'{kw}' out of order; a program is: program, param*, schedule, variants, kernel+")
        if order[kw] > 1 and schedule is None:
            raise _fail(ln.no, ln.col, f"'{kw}' before 'schedule'; the schedule line comes after the params")
        stage = order[kw]
        if kw == "kernel":
            kernels.append(_parse_kernel(cur))
            continue
        cur.take()
        if kw == "param":
            params.append(_parse_param(ln))
        elif kw == "schedule":
            schedule = _parse_schedule(ln)
        else:
            if kw in variants:
                raise _fail(ln.no, ln.col, f"{kw} defined twice")
            variants[kw] = _parse_variant(ln)
    if schedule is None:
        raise KBError(f"line {first.no}, column 1: program {head['name']} has no 'schedule' line")
    if not kernels:
        raise KBError(f"line {first.no}, column 1: program {head['name']} has no kernel")
    return Program(head["name"], tuple(params), schedule, tuple(kernels),
                   score_mod=variants.get("score_mod"), mask_mod=variants.get("mask_mod"))
