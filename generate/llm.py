"""The LLM transfer engine: an OpenAI-compatible chat model writes the target program in kbir.

`LLMEngine(settings).transfer(...)` runs the bounded loop of design step 3: ask, extract the
```kbir block, parse (`kb.ir.text.parse_program`), validate (`kb.ir.validate.validate`), then
the caller's `check(program)` (the interpreter against the spec). Any failure is sent back as
feedback in the same conversation, up to `settings.llm_max_attempts` answers.

Invariants:
- One request per attempt; the conversation grows by (answer, feedback) per failed attempt.
- `LLMResult.program` is set only when the last attempt parsed, validated and passed `check`.
- Service failures (missing settings, connection refused, timeout, HTTP errors, empty answers)
  raise `LLMServiceError`, a `KBError` whose message says what to set or check and which
  carries the attempts made so far; the client never retries on its own (max_retries=0).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import openai

from generate.prompts import Message, feedback_prompt, initial_messages
from kb.errors import KBError
from kb.ir.nodes import Program
from kb.ir.text import parse_program
from kb.ir.validate import validate
from kb.settings import Settings

__all__ = ["Stage", "LLMAttempt", "LLMResult", "LLMServiceError", "LLMEngine", "Check", "extract_ir"]

log = logging.getLogger(__name__)

Check = Callable[[Program], "str | None"]  # None = the program passed; else the failure text


class Stage(Enum):
    """How far an attempt got."""

    PARSE = "parse"  # the answer is not kbir
    VALIDATE = "validate"  # parsed, but breaks a validation rule
    CHECK = "check"  # valid, but the caller's check (interpreter vs spec) failed
    PASSED = "passed"


@dataclass(frozen=True)
class LLMAttempt:
    n: int  # 1-based
    raw_answer: str
    error: str | None  # None only when stage is PASSED
    stage: Stage
    ir_text: str  # what extract_ir took from the answer
    seconds: float  # request latency
    prompt_tokens: int = 0  # as the server reports them (0 when it does not)
    completion_tokens: int = 0


@dataclass(frozen=True)
class LLMResult:
    program: Program | None
    attempts: tuple[LLMAttempt, ...]
    model: str

    @property
    def ok(self) -> bool:
        return self.program is not None

    @property
    def ir_text(self) -> str | None:
        return self.attempts[-1].ir_text if self.ok else None

    @property
    def tokens(self) -> int:
        return sum(a.prompt_tokens + a.completion_tokens for a in self.attempts)


class LLMServiceError(KBError):
    """The LLM service could not be used; `attempts` holds the answers received before it failed."""

    def __init__(self, message: str, attempts: tuple[LLMAttempt, ...] = ()) -> None:
        super().__init__(message)
        self.attempts = attempts


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)


def extract_ir(answer: str) -> str:
    """The IR text of an answer: the last fenced block holding a whole program (```kbir preferred),
    else the first ```kbir block, else the whole answer; <think>...</think> sections are ignored."""
    text = _THINK.sub("", answer)
    blocks = [(lang.lower(), body.strip("\n")) for lang, body in _FENCE.findall(text)]
    programs = [(lang, body) for lang, body in blocks if body.lstrip().startswith("program ")]
    for choice in ([b for lang, b in programs if lang == "kbir"], [b for _, b in programs],
                   [b for lang, b in blocks if lang == "kbir"][:1]):
        if choice:
            return choice[-1]
    return text.strip()


def _check_settings(settings: Settings) -> None:
    missing = [env for env, value in (("KB_LLM_BASE_URL", settings.llm_base_url), ("KB_LLM_MODEL", settings.llm_model))
               if not value]
    if missing:
        raise LLMServiceError(
            f"the LLM engine needs {' and '.join(missing)}: set them in the environment or in $KB_HOME/config.toml "
            "(llm_base_url, e.g. http://localhost:8000/v1; llm_model, the served model name), "
            "or use --engine rule")
    if settings.llm_max_attempts < 1:
        raise LLMServiceError(f"KB_LLM_MAX_ATTEMPTS must be at least 1, not {settings.llm_max_attempts}")


class LLMEngine:
    """Transfers through an OpenAI-compatible chat-completions endpoint named by `settings`."""

    def __init__(self, settings: Settings) -> None:
        _check_settings(settings)
        self.settings = settings
        self.client = openai.OpenAI(base_url=settings.llm_base_url, api_key=settings.llm_api_key or "none",
                                    timeout=settings.llm_timeout_s, max_retries=0)

    # ------------------------------------------------------------ one request

    def _service_error(self, err: openai.OpenAIError) -> str:
        s, url = self.settings, self.settings.llm_base_url
        if isinstance(err, openai.APITimeoutError):
            return (f"the LLM server at {url} did not answer within {s.llm_timeout_s:g} s; "
                    "raise KB_LLM_TIMEOUT_S or check that the server is not overloaded")
        if isinstance(err, openai.APIConnectionError):
            return f"cannot connect to the LLM server at {url} ({err}); check KB_LLM_BASE_URL and that the server runs"
        if isinstance(err, openai.AuthenticationError):
            return f"the LLM server at {url} refused the API key (HTTP 401); set KB_LLM_API_KEY"
        if isinstance(err, openai.NotFoundError):
            return (f"the LLM server at {url} answered HTTP 404 ({_detail(err)}); check KB_LLM_MODEL={s.llm_model!r} "
                    "and that KB_LLM_BASE_URL ends with the API root (often /v1)")
        if isinstance(err, openai.APIStatusError):
            return (f"the LLM server at {url} answered HTTP {err.status_code} ({_detail(err)}); "
                    "check the server's log, KB_LLM_MODEL and KB_LLM_BASE_URL")
        return f"the LLM request to {url} failed: {type(err).__name__}: {err}"

    def _chat(self, messages: Sequence[Message]) -> tuple[str, float, int, int]:
        """(answer text, seconds, prompt tokens, completion tokens); OpenAIError on failure."""
        t0 = time.perf_counter()
        resp = self.client.chat.completions.create(
            model=self.settings.llm_model, messages=list(messages),  # type: ignore[arg-type]
            temperature=self.settings.llm_temperature)
        seconds = time.perf_counter() - t0
        if not resp.choices or resp.choices[0].message.content is None:
            raise LLMServiceError(f"the LLM server at {self.settings.llm_base_url} sent an answer with no text "
                                  f"(model {self.settings.llm_model!r}); check that it is a chat model")
        usage = resp.usage
        return (resp.choices[0].message.content, seconds,
                usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)

    def _ask(self, messages: Sequence[Message], attempts: tuple[LLMAttempt, ...]) -> tuple[str, float, int, int]:
        try:
            return self._chat(messages)
        except LLMServiceError as err:
            raise LLMServiceError(str(err), attempts) from None
        except openai.OpenAIError as err:
            log.debug("LLM request failed", exc_info=True)
            raise LLMServiceError(self._service_error(err), attempts) from None

    def propose(self, spec_summary: str, reference_ir: str, snippets: list[str], lessons: list[str],
                feedback: str | None = None) -> str:
        """One request without history: the IR text of the model's answer (not yet parsed)."""
        answer, *_ = self._ask(initial_messages(spec_summary, reference_ir, snippets, lessons, feedback), ())
        return extract_ir(answer)

    # ------------------------------------------------------------ the loop

    def transfer(self, spec_summary: str, reference_ir: str, snippets: list[str], lessons: list[str],
                 check: Check, *, max_attempts: int | None = None) -> LLMResult:
        """Ask, parse, validate, check; feed each failure back; stop at the first pass or the bound."""
        limit = max_attempts or self.settings.llm_max_attempts
        messages = initial_messages(spec_summary, reference_ir, snippets, lessons)
        attempts: list[LLMAttempt] = []
        for n in range(1, limit + 1):
            answer, seconds, p_tok, c_tok = self._ask(messages, tuple(attempts))
            ir_text = extract_ir(answer)
            program, stage, error = _judge(ir_text, check)
            attempts.append(LLMAttempt(n, answer, error, stage, ir_text, seconds, p_tok, c_tok))
            log.info("LLM attempt %d/%d: %s%s", n, limit, stage.value, f": {error.splitlines()[0]}" if error else "")
            if program is not None:
                return LLMResult(program, tuple(attempts), self.settings.llm_model)
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": feedback_prompt(f"[{stage.value} error] {error}")}]
        return LLMResult(None, tuple(attempts), self.settings.llm_model)


def _judge(ir_text: str, check: Check) -> tuple[Program | None, Stage, str | None]:
    try:
        program = parse_program(ir_text)
    except KBError as err:
        return None, Stage.PARSE, str(err)
    try:
        validate(program)
    except KBError as err:
        return None, Stage.VALIDATE, str(err)
    try:
        failure = check(program)
    except Exception as err:  # noqa: BLE001 - an untrusted program may break the interpreter in any way
        log.debug("check raised on an LLM program", exc_info=True)
        failure = f"running the program raised {type(err).__name__}: {err}"
    if failure is not None:
        return None, Stage.CHECK, failure
    return program, Stage.PASSED, None


def _detail(err: openai.APIStatusError) -> str:
    body = err.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return err.message
