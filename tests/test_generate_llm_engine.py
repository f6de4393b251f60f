"""The LLM transfer engine, driven over real HTTP through a fake OpenAI-compatible server:
a good answer passes at once; parse, validation and numeric failures go back as feedback in the
same conversation and a fixed answer then passes; attempts are bounded; server errors, timeouts,
refused connections and missing settings say what to set."""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable

import openai
import pytest
import torch

from generate.attempts import AttemptOutcome, Candidate, Cause
from generate.llm import LLMEngine, extract_ir
from generate.prompts import GRAMMAR, MAX_SNIPPETS, SYSTEM_PROMPT, snippet_text, spec_summary, user_prompt
from generate.spec import load_spec
from generate.stages import Stage
from kb.errors import KBError
from kb.ir.interpret import run_program
from kb.ir.nodes import Program
from kb.ir.text import print_program
from kb.settings import Settings, load_settings
from tests.support.attn_reference import reference_attention
from tests.support.fake_llm_server import FakeLLMServer, delayed, http_error
from tests.support.fixtures_llm import fake_llm, llm_settings  # noqa: F401 - pytest fixtures
from tests.support.ir_programs import alibi, causal, plain, sliding_window
from verify.result import Verdict

REPO = Path(__file__).resolve().parents[1]
SUMMARY = "variant slots:\n  mask_mod(b, h, q_idx, kv_idx) = q_idx >= kv_idx\nshapes: B=1 Hq=2 Hkv=1 M=20 N=20 D=8"
SNIPPETS = ["[mask] causal mask (from flash-attn==2.8.3 mask.h:10-20)\n"
            "```kbir\nmask s at (b, h, m_start, n_start) mask_mod\n```"]
LESSONS = ["causal masks: bound the KV loop by minimum(N, m_start + BLOCK_M)"]

Check = Callable[[Program], "str | None"]  # None = the program passed; else the failure text
Round = tuple[Candidate, AttemptOutcome]


def fenced(p: Program, chatter: str = "Here is the program.") -> str:
    return f"{chatter}\n\n```kbir\n{print_program(p)}```\nDone."


def numeric_check(target: Program, seed: int = 0) -> Check:
    """The caller's check: interpret the candidate and compare with dense attention for `target`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 20, 8, generator=g)  # [B, Hq, M, D]; GQA 2:1, ragged vs BLOCK 16
    k, v = torch.randn(1, 1, 20, 8, generator=g), torch.randn(1, 1, 20, 8, generator=g)
    o_ref, lse_ref = reference_attention(target, q, k, v, 0.35)

    def check(candidate: Program) -> str | None:
        out = run_program(candidate, {"q": q, "k": k, "v": v, "sm_scale": 0.35})
        err = (out["o"] - o_ref).abs().max().item()
        return None if err < 1e-5 else f"numeric mismatch: max |o - o_ref| = {err:.3g} on B=1 Hq=2 Hkv=1 M=N=20 D=8"

    return check


def run(engine: LLMEngine, check: Check, summary: str = SUMMARY, reference: str = "", snippets: list[str] = [],  # noqa: B006
        lessons: list[str] = [], max_attempts: int | None = None) -> list[Round]:  # noqa: B006
    """The pipeline's part reduced to `check` (the IR check): judge each candidate, send its outcome back."""
    proposals = engine.candidates(summary, reference, snippets, lessons, "k-ref", max_attempts=max_attempts)
    rounds: list[Round] = []
    while not rounds or not rounds[-1][1].passed:
        try:
            cand = next(proposals) if not rounds else proposals.send(rounds[-1][1])
        except StopIteration:
            break
        if cand.failure is not None:
            f = cand.failure
            stage, verdict, detail, cause = f.stage, f.verdict, f.detail, f.cause
        else:
            assert cand.program is not None and cand.untrusted
            try:
                problem = check(cand.program)
                verdict = Verdict.numeric_mismatch if problem else Verdict.passed
            except Exception as err:
                problem, verdict = f"running the program raised {type(err).__name__}: {err}", Verdict.runtime_error
            stage, detail, cause = Stage.IR_CHECK, problem or "", Cause.KERNEL
        rounds.append((cand, AttemptOutcome(len(rounds) + 1, cand.reference_id, cand.strategy, stage, verdict, detail,
                                            cand.seconds, cand.ir_text, cause)))
    return rounds


def last_user(request: dict) -> str:
    return request["messages"][-1]["content"]


# ---------------------------------------------------------------- the loop


def test_good_answer_passes_at_first_attempt(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(causal()))
    rounds = run(LLMEngine(llm_settings), numeric_check(causal()), reference=print_program(plain()), snippets=SNIPPETS,
                 lessons=LESSONS)
    ((cand, outcome),) = rounds
    assert outcome.passed and cand.program == causal() and cand.strategy == "llm" and cand.reference_id == "k-ref"
    assert cand.ir_text == print_program(causal()).rstrip("\n")
    (req,) = fake_llm.requests
    assert req["model"] == "fake-model" and req["temperature"] == 0.0
    assert [m["role"] for m in req["messages"]] == ["system", "user"]
    user = req["messages"][1]["content"]
    for part in (SUMMARY, print_program(plain()).rstrip(), SNIPPETS[0], LESSONS[0], "```kbir"):
        assert part in user


def test_unparsable_answer_gets_parse_error_as_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    bad = "```kbir\nprogram causal\nparam q: [B, Hq, M, D] f32 sideways\n```"
    fake_llm.script(bad, fenced(causal()))
    (first, _), (second, passed) = run(LLMEngine(llm_settings), numeric_check(causal()), reference=print_program(plain()))
    assert passed.passed and second.program == causal()
    assert first.program is None and first.failure.stage is Stage.TRANSFER
    assert first.failure.verdict is Verdict.compile_error and first.failure.detail.startswith("line 2, column")
    req1, req2 = fake_llm.requests
    # conversation history kept: system, user, the bad answer, the feedback
    assert [m["role"] for m in req2["messages"]] == ["system", "user", "assistant", "user"]
    assert req2["messages"][:2] == req1["messages"] and req2["messages"][2]["content"] == bad
    assert "[parse error]" in last_user(req2) and first.failure.detail in last_user(req2)


def test_invalid_program_gets_validation_problems_as_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    broken = print_program(causal()).replace("store o[", "store oo[")  # parses, but o is never stored
    fake_llm.script(f"```kbir\n{broken}```", fenced(causal()))
    (first, _), (_, passed) = run(LLMEngine(llm_settings), numeric_check(causal()), reference=print_program(plain()))
    assert passed.passed
    assert first.failure.stage is Stage.TRANSFER and "'oo'" in first.failure.detail
    assert "[validate error]" in last_user(fake_llm.requests[1]) and "'oo'" in last_user(fake_llm.requests[1])


def test_numerically_wrong_program_then_fixed(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(plain(), "The causal mask is not needed."), fenced(causal(), "Added the causal mask."))
    (_, wrong), (second, passed) = run(LLMEngine(llm_settings), numeric_check(causal()),
                                       reference=print_program(plain()), snippets=SNIPPETS, lessons=LESSONS)
    assert passed.passed and second.program == causal()
    assert wrong.stage is Stage.IR_CHECK and wrong.feedback.startswith("numeric mismatch")
    assert fake_llm.requests[1]["messages"][2]["content"].startswith("The causal mask is not needed.")
    assert "[check error] numeric mismatch" in last_user(fake_llm.requests[1])


def test_a_later_stage_failure_is_named_in_the_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(causal()), fenced(causal()))
    proposals = LLMEngine(llm_settings).candidates(SUMMARY, "", [], [], "k-ref")
    cand = next(proposals)
    lowered = AttemptOutcome(1, "k-ref", "llm", Stage.LOWER, Verdict.compile_error, "no lowering for it", 0.1,
                             cand.ir_text)
    proposals.send(lowered)
    assert "[check error] lower failed (compile_error): no lowering for it" in last_user(fake_llm.requests[1])


def test_attempts_are_bounded(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(*[fenced(plain())] * 3, fenced(causal()))  # the fix would come too late
    rounds = run(LLMEngine(replace(llm_settings, llm_max_attempts=2)), numeric_check(causal()))
    assert [o.stage for _, o in rounds] == [Stage.IR_CHECK, Stage.IR_CHECK] and not rounds[-1][1].passed
    assert len(fake_llm.requests) == 2 and fake_llm.pending == 2
    # the conversation grows by (answer, feedback) per failed attempt
    assert [len(r["messages"]) for r in fake_llm.requests] == [2, 4]


def test_propose_extracts_ir_and_sends_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(sliding_window()))
    text = LLMEngine(llm_settings).propose(SUMMARY, print_program(plain()), [], [], "numeric mismatch: 0.4")
    assert text == print_program(sliding_window()).rstrip("\n")
    (req,) = fake_llm.requests
    assert "numeric mismatch: 0.4" in req["messages"][1]["content"]


# ---------------------------------------------------------------- service failures


def test_server_error_ends_the_proposals_with_what_to_check(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(plain()), http_error(500, "model crashed"))
    (first, wrong), (last, _) = run(LLMEngine(llm_settings), numeric_check(causal()))
    assert wrong.stage is Stage.IR_CHECK  # the answer before the failure is kept for the run record
    msg = last.failure.detail
    assert last.program is None and last.failure.cause is Cause.ENVIRONMENT and last.failure.verdict is Verdict.runtime_error
    assert "HTTP 500" in msg and "model crashed" in msg and fake_llm.base_url in msg


def test_timeout_says_what_to_raise(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(delayed(3.0, fenced(causal())))
    engine = LLMEngine(replace(llm_settings, llm_timeout_s=1.0))
    ((cand, _),) = run(engine, numeric_check(causal()))
    assert re.search(r"did not answer within 1 s; raise KB_LLM_TIMEOUT_S", cand.failure.detail)
    assert len(fake_llm.requests) == 1  # max_retries=0: one request, cut at the timeout, never retried


def test_connection_refused_is_a_clear_kberror(llm_settings: Settings) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = replace(llm_settings, llm_base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(KBError, match=r"cannot connect to the LLM server at .*check KB_LLM_BASE_URL"):
        LLMEngine(settings).propose(SUMMARY, "", [], [])


def test_unknown_route_names_model_and_base_url(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    settings = replace(llm_settings, llm_base_url=fake_llm.base_url.removesuffix("/v1"))
    with pytest.raises(KBError, match=r"HTTP 404 .*KB_LLM_MODEL.*KB_LLM_BASE_URL"):
        LLMEngine(settings).propose(SUMMARY, "", [], [])


@pytest.mark.parametrize("missing, named", [
    (dict(llm_base_url=""), "KB_LLM_BASE_URL"),
    (dict(llm_model=""), "KB_LLM_MODEL"),
    (dict(llm_base_url="", llm_model=""), "KB_LLM_BASE_URL and KB_LLM_MODEL"),
])
def test_missing_settings_name_what_to_set(llm_settings: Settings, missing: dict, named: str) -> None:
    with pytest.raises(KBError, match=f"needs {named}"):
        LLMEngine(replace(llm_settings, **missing))


def test_settings_come_from_env(monkeypatch: pytest.MonkeyPatch, fake_llm: FakeLLMServer) -> None:
    monkeypatch.setenv("KB_LLM_BASE_URL", fake_llm.base_url)
    monkeypatch.setenv("KB_LLM_MODEL", "env-model")
    monkeypatch.setenv("KB_LLM_TEMPERATURE", "0.7")
    fake_llm.script(fenced(causal()))
    LLMEngine(load_settings()).propose(SUMMARY, "", [], [])
    assert fake_llm.requests[0]["model"] == "env-model" and fake_llm.requests[0]["temperature"] == 0.7


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize("answer, expected", [
    ("```kbir\nprogram a\n```", "program a"),
    ("text\n```python\nx = 1\n```\n```kbir\nprogram b\n  x\n```\nmore", "program b\n  x"),
    ("```\nprogram c\n```", "program c"),  # untagged fence holding a program
    ("<think>```kbir\nprogram draft\n```</think>```kbir\nprogram d\n```", "program d"),
    ("```kbir\nprogram e\n", "program e"),  # answer cut before the closing fence
    ("program f\n", "program f"),  # no fence: the whole answer
    ("reference:\n```kbir\nprogram ref\n```\ntarget:\n```kbir\nprogram g\n```", "program g"),  # last program
    ("```kbir\nmask s at (b, h, m, n) mask_mod\n```", "mask s at (b, h, m, n) mask_mod"),  # a fragment
])
def test_extract_ir(answer: str, expected: str) -> None:
    assert extract_ir(answer) == expected


# ---------------------------------------------------------------- prompts and the fake server


def test_prompt_grammar_is_the_docs_grammar() -> None:
    doc = (REPO / "docs" / "ir.md").read_text()
    block = re.search(r"## Text form.*?```\n(.*?)```", doc, re.S).group(1)
    assert GRAMMAR == block, "docs/ir.md's grammar changed: copy it into generate/prompts.py GRAMMAR"
    assert GRAMMAR in SYSTEM_PROMPT and "exactly one ```kbir" in SYSTEM_PROMPT


def test_user_prompt_is_bounded() -> None:
    many = [f"[mask] snippet {i}" for i in range(MAX_SNIPPETS + 5)]
    text = user_prompt(SUMMARY, "program x", many, [], "e" * 10_000)
    assert f"snippet {MAX_SNIPPETS - 1}" in text and f"snippet {MAX_SNIPPETS}" not in text
    assert "more characters cut" in text and len(text) < 4000


def test_snippet_text_carries_meaning_and_provenance() -> None:
    class Snip:
        kind, title, where = "softcap", "logit softcap", "flash-attn==2.8.3.post2 csrc/softmax.h:40-52"
        ir_text = "score_mod(score, b, h, q_idx, kv_idx) = softcap * tanh(score / softcap)"

    text = snippet_text(Snip())
    assert text.startswith("[softcap] logit softcap (from flash-attn==2.8.3.post2 csrc/softmax.h:40-52)")
    assert "```kbir\nscore_mod(score, b, h, q_idx, kv_idx) = softcap * tanh(score / softcap)\n```" in text


@pytest.fixture(scope="module")
def alibi_spec():
    return load_spec(REPO / "examples" / "specs" / "flex_alibi_causal.py")


def test_spec_summary_of_a_real_spec(alibi_spec) -> None:
    spec = alibi_spec
    text = spec_summary(spec)
    assert spec.variants_text().splitlines()[0] in text
    assert f"B={spec.shapes.B} Hq={spec.shapes.Hq}" in text and spec.features.describe() in text
    assert "def score_mod" in text  # the torch reference source
    assert "  param SLOPES: [8] f32 aux" in text  # ready to paste into the program


def test_transfer_for_a_real_spec_checked_against_its_own_reference(
        fake_llm: FakeLLMServer, llm_settings: Settings, alibi_spec) -> None:
    """The caller's path: summary of a real spec; check = interpreter vs the spec's torch reference."""
    spec = alibi_spec
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, spec.shapes.Hq, 20, 8, generator=g) for _ in range(3))  # tiny, ragged vs 16
    o_ref = spec.reference(q, k, v)

    def check(p: Program) -> str | None:
        out = run_program(p, {"q": q, "k": k, "v": v, "sm_scale": spec.softmax_scale, **spec.aux})
        err = (out["o"] - o_ref).abs().max().item()
        return None if err < 1e-4 else f"numeric mismatch: max |o - o_ref| = {err:.3g}"

    fixed = print_program(alibi()).replace("slopes", "SLOPES")
    fake_llm.script(fenced(causal(), "Kept the causal mask."), f"```kbir\n{fixed}```")
    rounds = run(LLMEngine(llm_settings), check, spec_summary(spec), print_program(causal()))
    assert rounds[-1][0].program.score_mod is not None
    assert [(o.stage, o.verdict) for _, o in rounds] == [(Stage.IR_CHECK, Verdict.runtime_error),  # SLOPES unused
                                                          (Stage.IR_CHECK, Verdict.passed)]
    assert "[check error] running the program raised KBError" in last_user(fake_llm.requests[1])
    first_user = fake_llm.requests[0]["messages"][1]["content"]
    assert "score + SLOPES[h] * (kv_idx - q_idx)" in first_user and "param SLOPES: [8] f32 aux" in first_user


def test_fake_server_models_route_and_clean_shutdown() -> None:
    with FakeLLMServer(model="m1") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=5)
        assert [m.id for m in client.models.list()] == ["m1"]
        with pytest.raises(openai.InternalServerError, match="no scripted reply left"):
            client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        port = srv.port
    with socket.socket() as s:  # released: nothing answers there any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_fake_server_close_does_not_wait_for_a_delayed_reply() -> None:
    srv = FakeLLMServer().start()
    srv.script(delayed(3600.0))
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    closing = threading.Thread(target=srv.close, daemon=True)
    closing.start()
    closing.join(timeout=300)  # a hang guard: the reply is due in an hour, close must not wait for it
    assert not closing.is_alive()


def test_fake_server_repeat_last_serves_the_last_reply_again() -> None:
    with FakeLLMServer(repeat_last=True) as srv:
        srv.script("first", "second")
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=5)
        texts = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                 .choices[0].message.content for _ in range(3)]
    assert texts == ["first", "second", "second"] and len(srv.requests) == 3
