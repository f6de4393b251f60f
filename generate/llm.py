"""The LLM transfer engine: an OpenAI-compatible chat model writes the target program in kbir.

`LLMEngine(settings).candidates(...)` is the LLM engine of `kb generate` (a `generate.attempts.Proposals`,
design step 3): ask, extract the ```kbir block, parse (`kb.ir.text.parse_program`), validate
(`kb.ir.validate.validate`) and yield the program as a candidate; the pipeline judges it (the interpreter
against the spec, lowering, verification) and sends the outcome back. Any failure goes back to the model
as feedback in the same conversation, up to `max_attempts` answers.

Invariants:
- One request per candidate; the conversation grows by (answer, feedback) per failed attempt.
- A candidate has a program only when the answer parsed and validated; its program is `untrusted`.
- Service failures (connection refused, timeout, HTTP errors, empty answers) end the proposals with a
  candidate without a program whose cause is the environment; its message says what to set or check, and
  names the server by its redacted URL (`kb.redact`: no user-info or key reaches attempts, runs or reports).
  Missing settings raise `LLMServiceError`, a `KBError`, when the engine is made. The client never
  retries on its own (max_retries=0).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Sequence

import openai

from generate.attempts import AttemptOutcome, Candidate, Cause, Failure, Proposals
from generate.prompts import Message, feedback_prompt, initial_messages
from generate.stages import Stage
from kb.errors import KBError
from kb.ir.nodes import Program
from kb.ir.text import parse_program
from kb.ir.validate import validate
from kb.redact import redact_text, redact_url
from kb.settings import Settings
from verify.result import Verdict

__all__ = ["LLM_STRATEGY", "LLMServiceError", "LLMEngine", "extract_ir"]

log = logging.getLogger(__name__)

LLM_STRATEGY = "llm"  # the strategy name of the LLM's attempts (their rows, lessons and the report)


class LLMServiceError(KBError):
    """The LLM service could not be used."""


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
        return redact_text(self._service_message(err))

    def _service_message(self, err: openai.OpenAIError) -> str:
        s, url = self.settings, redact_url(self.settings.llm_base_url)
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
            model=self.settings.llm_model, messages=list(messages),
            temperature=self.settings.llm_temperature)
        seconds = time.perf_counter() - t0
        if not resp.choices or resp.choices[0].message.content is None:
            raise LLMServiceError(f"the LLM server at {redact_url(self.settings.llm_base_url)} sent an answer with no text "
                                  f"(model {self.settings.llm_model!r}); check that it is a chat model")
        usage = resp.usage
        return (resp.choices[0].message.content, seconds,
                usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)

    def _ask(self, messages: Sequence[Message]) -> tuple[str, float, int, int]:
        try:
            return self._chat(messages)
        except openai.OpenAIError as err:
            log.debug("LLM request failed", exc_info=True)
            raise LLMServiceError(self._service_error(err)) from None

    def propose(self, spec_summary: str, reference_ir: str, snippets: list[str], lessons: list[str],
                feedback: str | None = None) -> str:
        """One request without history: the IR text of the model's answer (not yet parsed)."""
        answer, *_ = self._ask(initial_messages(spec_summary, reference_ir, snippets, lessons, feedback))
        return extract_ir(answer)

    # ------------------------------------------------------------ the engine

    def candidates(self, spec_summary: str, reference_ir: str, snippets: list[str], lessons: list[str],
                   reference_id: str, *, max_attempts: int | None = None) -> Proposals:
        """Ask, parse, validate, yield; feed each outcome that did not pass back; stop at the bound."""
        limit = max_attempts or self.settings.llm_max_attempts
        messages = initial_messages(spec_summary, reference_ir, snippets, lessons)
        for n in range(1, limit + 1):
            try:
                answer, seconds, p_tok, c_tok = self._ask(messages)
            except LLMServiceError as err:
                yield Candidate(reference_id, LLM_STRATEGY, None, "", 0.0,
                                Failure(Stage.TRANSFER, Verdict.runtime_error, str(err), Cause.ENVIRONMENT))
                return
            ir_text = extract_ir(answer)
            program, refused = _parse(ir_text)
            failure = Failure(Stage.TRANSFER, Verdict.compile_error, refused[1]) if refused else None
            outcome = yield Candidate(reference_id, LLM_STRATEGY, program, ir_text, seconds, failure, untrusted=True)
            log.info("LLM attempt %d/%d: %s %s (%d + %d tokens)", n, limit, outcome.stage.value, outcome.verdict.value,
                     p_tok, c_tok)
            if outcome.passed:
                return
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": feedback_prompt(_feedback(outcome, refused))}]


def _parse(ir_text: str) -> tuple[Program | None, tuple[str, str] | None]:
    """(the validated program, None), or (None, ("parse" | "validate", why not))."""
    try:
        program = parse_program(ir_text)
    except KBError as err:
        return None, ("parse", str(err))
    try:
        validate(program)
    except KBError as err:
        return None, ("validate", str(err))
    return program, None


def _feedback(outcome: AttemptOutcome, refused: tuple[str, str] | None) -> str:
    """What the model reads about its last answer: `[parse error] ...`, `[validate error] ...` or `[check error] ...`
    (the IR check's finding, or the later stage that failed and its verdict)."""
    if refused is not None:
        return f"[{refused[0]} error] {refused[1]}"
    if outcome.stage is Stage.IR_CHECK:
        return f"[check error] {outcome.feedback}"
    return f"[check error] {outcome.stage.value} failed ({outcome.verdict.value}): {outcome.feedback}"


def _detail(err: openai.APIStatusError) -> str:
    body = err.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return err.message
