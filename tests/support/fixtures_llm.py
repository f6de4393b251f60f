"""Pytest fixtures for the LLM engine: a live fake OpenAI-compatible server and settings pointing at it.

Import them into a test module (`from tests.support.fixtures_llm import fake_llm, llm_settings`); the server
serves only while the fixture lives and is shut down (port released) when the test ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kb.settings import Settings, load_settings
from tests.support.fake_llm_server import FakeLLMServer

__all__ = ["fake_llm", "llm_settings"]


@pytest.fixture
def fake_llm() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as server:
        yield server


@pytest.fixture
def llm_settings(fake_llm: FakeLLMServer, tmp_path: Path) -> Settings:
    """Settings for the fake server: 5 s client timeout, 3 attempts (tests `replace` what they vary)."""
    base = load_settings(home=tmp_path / "kb")
    return replace(base, llm_base_url=fake_llm.base_url, llm_model=fake_llm.model, llm_timeout_s=5.0,
                   llm_max_attempts=3, llm_temperature=0.0)
