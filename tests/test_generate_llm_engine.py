"""The LLM transfer engine, driven over real HTTP through a fake OpenAI-compatible server:
a good answer passes at once; parse, validation and numeric failures go back as feedback in the
same conversation and a fixed answer then passes; attempts are bounded; server errors, timeouts,
refused connections and missing settings are KBErrors that say what to set."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

from generate.llm import LLMEngine, LLMServiceError, Stage, extract_ir
from generate.prompts import GRAMMAR, MAX_SNIPPETS, SYSTEM_PROMPT, snippet_text, spec_summary, user_prompt
from kb.errors import KBError
from kb.ir.interpret import run_program
from kb.ir.nodes import Program
from kb.ir.text import print_program
from kb.settings import Settings
from tests.support.attn_reference import reference_attention
from tests.support.fake_llm_server import FakeLLMServer, delayed, http_error
from tests.support.fixtures_llm import fake_llm, llm_settings  # noqa: F401 - pytest fixtures
from tests.support.ir_programs import alibi, causal, plain, sliding_window

REPO = Path(__file__).resolve().parents[1]
SUMMARY = "variant slots:\n  mask_mod(b, h, q_idx, kv_idx) = q_idx >= kv_idx\nshapes: B=1 Hq=2 Hkv=1 M=20 N=20 D=8"
SNIPPETS = ["[mask] causal mask (from flash-attn==2.8.3 mask.h:10-20)\n"
            "```kbir\nmask s at (b, h, m_start, n_start) mask_mod\n```"]
LESSONS = ["causal masks: bound the KV loop by minimum(N, m_start + BLOCK_M)"]


def fenced(p: Program, chatter: str = "Here is the program.") -> str:
    return f"{chatter}\n\n```kbir\n{print_program(p)}```\nDone."


def numeric_check(target: Program, seed: int = 0):
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


def last_user(request: dict) -> str:
    return request["messages"][-1]["content"]


# ---------------------------------------------------------------- the loop


def test_good_answer_passes_at_first_attempt(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(causal()))
    result = LLMEngine(llm_settings).transfer(SUMMARY, print_program(plain()), SNIPPETS, LESSONS, numeric_check(causal()))
    assert result.ok and result.program == causal()
    assert [(a.n, a.stage, a.error) for a in result.attempts] == [(1, Stage.PASSED, None)]
    assert result.ir_text == print_program(causal()).rstrip("\n")
    assert result.tokens > 0 and result.model == "fake-model"
    (req,) = fake_llm.requests
    assert req["model"] == "fake-model" and req["temperature"] == 0.0
    assert [m["role"] for m in req["messages"]] == ["system", "user"]
    user = req["messages"][1]["content"]
    for part in (SUMMARY, print_program(plain()).rstrip(), SNIPPETS[0], LESSONS[0], "```kbir"):
        assert part in user


def test_unparsable_answer_gets_parse_error_as_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    bad = "```kbir\nprogram causal\nparam q: [B, Hq, M, D] f32 sideways\n```"
    fake_llm.script(bad, fenced(causal()))
    result = LLMEngine(llm_settings).transfer(SUMMARY, print_program(plain()), [], [], numeric_check(causal()))
    assert result.ok and result.program == causal()
    first, second = result.attempts
    assert first.stage is Stage.PARSE and first.error.startswith("line 2, column")
    assert second.stage is Stage.PASSED
    req1, req2 = fake_llm.requests
    # conversation history kept: system, user, the bad answer, the feedback
    assert [m["role"] for m in req2["messages"]] == ["system", "user", "assistant", "user"]
    assert req2["messages"][:2] == req1["messages"] and req2["messages"][2]["content"] == bad
    assert "[parse error]" in last_user(req2) and first.error in last_user(req2)


def test_invalid_program_gets_validation_problems_as_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    broken = print_program(causal()).replace("store o[", "store oo[")  # parses, but o is never stored
    fake_llm.script(f"```kbir\n{broken}```", fenced(causal()))
    result = LLMEngine(llm_settings).transfer(SUMMARY, print_program(plain()), [], [], numeric_check(causal()))
    assert result.ok
    assert result.attempts[0].stage is Stage.VALIDATE and "'oo'" in result.attempts[0].error
    assert "[validate error]" in last_user(fake_llm.requests[1]) and "'oo'" in last_user(fake_llm.requests[1])


def test_numerically_wrong_program_then_fixed(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(plain(), "The causal mask is not needed."), fenced(causal(), "Added the causal mask."))
    result = LLMEngine(llm_settings).transfer(SUMMARY, print_program(plain()), SNIPPETS, LESSONS, numeric_check(causal()))
    assert result.ok and result.program == causal()
    wrong = result.attempts[0]
    assert wrong.stage is Stage.CHECK and wrong.error.startswith("numeric mismatch")
    assert wrong.raw_answer.startswith("The causal mask is not needed.")
    assert "[check error] numeric mismatch" in last_user(fake_llm.requests[1])


def test_attempts_are_bounded(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(*[fenced(plain())] * 3, fenced(causal()))  # the fix would come too late
    result = LLMEngine(replace(llm_settings, llm_max_attempts=2)).transfer(
        SUMMARY, print_program(plain()), [], [], numeric_check(causal()))
    assert not result.ok and result.program is None and result.ir_text is None
    assert [a.stage for a in result.attempts] == [Stage.CHECK, Stage.CHECK]
    assert len(fake_llm.requests) == 2 and fake_llm.pending == 2
    # the conversation grows by (answer, feedback) per failed attempt
    assert [len(r["messages"]) for r in fake_llm.requests] == [2, 4]


def test_check_that_raises_is_a_failed_attempt(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    def check(p: Program) -> str | None:
        raise RuntimeError("shape mismatch in dot")

    fake_llm.script(fenced(causal()))
    result = LLMEngine(replace(llm_settings, llm_max_attempts=1)).transfer(SUMMARY, "", [], [], check)
    assert not result.ok and result.attempts[0].stage is Stage.CHECK
    assert "RuntimeError: shape mismatch in dot" in result.attempts[0].error


def test_propose_extracts_ir_and_sends_feedback(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(sliding_window()))
    text = LLMEngine(llm_settings).propose(SUMMARY, print_program(plain()), [], [], "numeric mismatch: 0.4")
    assert text == print_program(sliding_window()).rstrip("\n")
    (req,) = fake_llm.requests
    assert "numeric mismatch: 0.4" in req["messages"][1]["content"]


# ---------------------------------------------------------------- service failures


def test_server_error_is_a_clear_kberror(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(fenced(plain()), http_error(500, "model crashed"))
    with pytest.raises(LLMServiceError) as info:
        LLMEngine(llm_settings).transfer(SUMMARY, "", [], [], numeric_check(causal()))
    msg = str(info.value)
    assert isinstance(info.value, KBError)
    assert "HTTP 500" in msg and "model crashed" in msg and fake_llm.base_url in msg
    assert len(info.value.attempts) == 1 and info.value.attempts[0].stage is Stage.CHECK  # kept for the run record


def test_timeout_is_a_clear_kberror(fake_llm: FakeLLMServer, llm_settings: Settings) -> None:
    fake_llm.script(delayed(3.0, fenced(causal())))
    engine = LLMEngine(replace(llm_settings, llm_timeout_s=1.0))
    t0 = time.perf_counter()
    with pytest.raises(KBError, match=r"did not answer within 1 s; raise KB_LLM_TIMEOUT_S"):
        engine.transfer(SUMMARY, "", [], [], numeric_check(causal()))
    assert time.perf_counter() - t0 < 2.5  # max_retries=0: one request, cut at the timeout


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
    from kb.settings import load_settings

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
    from generate.spec import load_spec

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
    result = LLMEngine(llm_settings).transfer(spec_summary(spec), print_program(causal()), [], [], check)
    assert result.ok and result.program.score_mod is not None
    assert [a.stage for a in result.attempts] == [Stage.CHECK, Stage.PASSED]
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
    srv.script(delayed(30.0))
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    t0 = time.perf_counter()
    srv.close()
    assert time.perf_counter() - t0 < 2.0


def test_fake_server_repeat_last_serves_the_last_reply_again() -> None:
    with FakeLLMServer(repeat_last=True) as srv:
        srv.script("first", "second")
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=5)
        texts = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                 .choices[0].message.content for _ in range(3)]
    assert texts == ["first", "second", "second"] and len(srv.requests) == 3
