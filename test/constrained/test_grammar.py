"""Grammars (xgrammar) with the tiny model's tokenizer: whatever the logits, text sampled under
the batch bitmask follows its regex / JSON schema / EBNF, and ends with a stop token once the
grammar is complete; rows without a grammar are left alone; bad grammars are a ValueError
naming the field."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from srt.constrained.grammar import (
    GrammarBackend,
    GrammarSpec,
    apply_bitmask_,
    batch_bitmask,
    check_grammar,
    grammar_spec,
)
from srt.layers.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
}
REGEX = r"(yes|no)-[0-9]{2}"
EBNF = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'


@pytest.fixture(scope="module")
def model(qwen3_moe_path):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_moe_path)
    vocab = AutoConfig.from_pretrained(qwen3_moe_path).vocab_size
    return tokenizer, vocab, GrammarBackend(tokenizer, vocab, {tokenizer.eos_token_id})


def _sample(model, spec: GrammarSpec, seed: int, max_tokens: int = 40) -> tuple[str, bool]:
    """Random logits, masked: the decoded text and whether the grammar completed."""
    tokenizer, vocab, backend = model
    grammar = backend.matcher(spec)
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_tokens):
        logits = torch.randn(1, vocab, generator=generator) * 4
        apply_bitmask_(logits, batch_bitmask([grammar], vocab))
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        assert grammar.accept_token(token)
        if grammar.is_terminated():
            assert token == tokenizer.eos_token_id
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


@pytest.mark.parametrize("seed", range(4))
def test_sampled_text_follows_the_grammar(model, seed):
    text, done = _sample(model, GrammarSpec("regex", REGEX), seed)
    assert done and re.fullmatch(REGEX, text), text
    text, done = _sample(model, GrammarSpec("ebnf", EBNF), seed)
    assert done and re.fullmatch(r"\([0-9](,[0-9])*\)", text), text
    text, done = _sample(model, GrammarSpec("json_schema", json.dumps(SCHEMA)), seed, 80)
    assert done, text
    value = json.loads(text)
    assert set(value) == {"name", "age"} and value["name"] in ("ada", "bob")
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99


def test_rows_without_a_grammar_are_untouched(model):
    _, vocab, backend = model
    assert batch_bitmask([None, None], vocab) is None
    mask = batch_bitmask([None, backend.matcher(GrammarSpec("regex", "a"))], vocab)
    logits = torch.zeros(2, vocab)
    apply_bitmask_(logits, mask)
    assert torch.isfinite(logits[0]).all()
    assert 0 < torch.isfinite(logits[1]).sum() < vocab


def test_sampler_applies_the_mask_to_greedy_rows(model):
    tokenizer, vocab, backend = model
    params = [SamplingParams(temperature=0, max_new_tokens=4) for _ in range(2)]
    for p in params:
        p.normalize(None)
    grammars = [backend.matcher(GrammarSpec("regex", "z")), None]
    info = SamplingBatchInfo.from_params(
        params, [[], []], [[1], [1]], [None, None], [set(), set()], vocab, "cpu", grammars
    )
    logits = torch.randn(2, vocab)
    ids = Sampler()(logits, info)
    assert tokenizer.decode([int(ids[0])]) == "z"
    assert int(ids[1]) == int(logits[1].argmax())


@pytest.mark.parametrize(
    "kind, source", [("regex", "("), ("json_schema", "{"), ("json_schema", "[1"), ("ebnf", "x")]
)
def test_bad_grammars_name_the_field(kind, source):
    with pytest.raises(ValueError, match=f"{kind} is not valid") as info:
        check_grammar(GrammarSpec(kind, source))
    assert "/project/" not in str(info.value)


def test_one_constraint_per_request():
    assert grammar_spec(SamplingParams.from_dict({"regex": ""})) is None
    assert grammar_spec(SamplingParams.from_dict({"ebnf": EBNF})) == GrammarSpec("ebnf", EBNF)
    with pytest.raises(ValueError, match="only one of json_schema, regex and ebnf"):
        grammar_spec(SamplingParams.from_dict({"regex": "a", "json_schema": "{}"}))
