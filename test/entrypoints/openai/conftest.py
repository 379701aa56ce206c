"""Fixtures of the OpenAI-layer tests: a fake tokenizer manager and a client of the app."""

from __future__ import annotations

import pytest
from openai_fakes import FakeTokenizerManager, make_client


@pytest.fixture
def tm() -> FakeTokenizerManager:
    return FakeTokenizerManager()


@pytest.fixture
def client(tm: FakeTokenizerManager):
    return make_client(tm)
