from __future__ import annotations

import pytest

from srt.sampling.sampling_params import SamplingParams


def test_defaults_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.min_new_tokens, p.ignore_eos, p.n, p.sampling_seed) == (0, False, 1, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.stop is None and p.stop_token_ids is None


def test_from_dict_good_values():
    d = {
        "max_new_tokens": 16,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["a", "bc"],
        "stop_token_ids": [3, 4],
        "sampling_seed": 7,
        "ignore_eos": True,
        "repetition_penalty": None,
    }
    p = SamplingParams.from_dict(d)
    p.verify(vocab_size=100)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.repetition_penalty == 1.0  # None means default
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_unknown_field_named():
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"foo": 1})


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", [0.5]),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("top_k", 2.0),
        ("min_new_tokens", "3"),
        ("stop", 5),
        ("stop", ["a", 1]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [1.0]),
        ("ignore_eos", 1),
        ("sampling_seed", 1.0),
    ],
)
def test_wrong_type_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", -3.0),
        ("presence_penalty", 2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("min_new_tokens", 200),
        ("stop_token_ids", [5, 100]),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_names_field(field, value):
    p = SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError, match=field):
        p.verify(vocab_size=100)


def test_n_below_one_rejected():
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0).verify()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0},
        {"max_new_tokens": 0, "min_new_tokens": 0},
        {"max_new_tokens": 5, "min_new_tokens": 5, "stop_token_ids": [0, 99]},
    ],
)
def test_boundary_values_pass(kwargs):
    SamplingParams(**kwargs).verify(vocab_size=100)


def test_stop_token_ids_unchecked_without_vocab_size():
    SamplingParams(stop_token_ids=[10**9]).verify()


class _CharTokenizer:
    """Two characters per token, to tell token length from character length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return list(range((len(text) + 1) // 2))


def test_normalize_stop_forms():
    p = SamplingParams(stop="abcde", stop_token_ids=[3, 3, 4])
    p.normalize(_CharTokenizer())
    assert p.stop == ["abcde"] and p.stop_token_ids == {3, 4}
    assert p.stop_str_max_len == 3
    p.normalize(_CharTokenizer())  # idempotent
    assert p.stop == ["abcde"] and p.stop_token_ids == {3, 4}

    q = SamplingParams()
    q.normalize(None)
    assert q.stop == [] and q.stop_token_ids == set() and q.stop_str_max_len == 0

    r = SamplingParams(stop=["ab", "abcdefg"])
    r.normalize(None)
    assert r.stop_str_max_len == 7


def test_normalize_greedy():
    p = SamplingParams(temperature=0.0, top_k=50)
    assert p.is_greedy
    p.normalize(None)
    assert p.top_k == 1 and p.temperature == 1.0 and p.is_greedy
    q = SamplingParams(temperature=0.7)
    q.normalize(None)
    assert not q.is_greedy and q.temperature == 0.7 and q.top_k == -1
    assert SamplingParams(top_k=1).is_greedy
