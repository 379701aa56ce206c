from __future__ import annotations

import math

import pytest
import torch

from srt.layers.sampler import Sampler, get_token_logprobs, get_top_logprobs, make_generator
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams

VOCAB = 32
# A known distribution over 5 tokens; the rest of the vocabulary has probability 0.
KNOWN_PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def _params(**kwargs) -> SamplingParams:
    p = SamplingParams(**kwargs)
    p.verify(VOCAB)
    p.normalize(None)
    return p


def _info(params, outputs=None, inputs=None, generators=None, eos=None, vocab=VOCAB):
    n = len(params)
    return SamplingBatchInfo.from_params(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        inputs if inputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [set() for _ in range(n)],
        vocab,
        "cpu",
    )


def _known_logits(rows: int) -> torch.Tensor:
    logits = torch.full((rows, VOCAB), float("-inf"))
    logits[:, : len(KNOWN_PROBS)] = torch.tensor(KNOWN_PROBS).log()
    return logits


def _random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_and_top_k_one_are_argmax():
    logits = _random_logits(6)
    for params in ([_params(temperature=0.0)] * 6, [_params(top_k=1, temperature=0.8)] * 6):
        info = _info(params)
        assert info.is_all_greedy
        assert torch.equal(Sampler(1)(logits, info), logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_are_argmax_of_penalised_logits():
    logits = _random_logits(4, seed=3)
    params = [
        _params(temperature=0.0, frequency_penalty=2.0),
        _params(temperature=1.5, top_p=0.5),
        _params(top_k=1, repetition_penalty=2.0),
        _params(min_p=0.2),
    ]
    outputs = [[int(logits[0].argmax())] * 3, [1], [int(logits[2].argmax())], []]
    info = _info(params, outputs=outputs)
    assert not info.is_all_greedy
    penalised = logits.clone()
    info.apply_penalties_(penalised)
    for seed in range(10):
        ids = Sampler(seed)(logits, info)
        assert ids[0] == penalised[0].argmax() and ids[2] == penalised[2].argmax()
    assert ids.dtype == torch.int64 and ids.shape == (4,)


def test_sampler_does_not_modify_caller_logits():
    logits = _random_logits(2)
    before = logits.clone()
    params = [_params(frequency_penalty=1.0, min_new_tokens=2), _params(repetition_penalty=1.5)]
    info = _info(params, outputs=[[1, 2], [3]], inputs=[[4], [5]], eos=[{0}, {0}])
    Sampler(0)(logits, info)
    assert torch.equal(logits, before)


def _run_seeded(
    seed: int,
    steps: int,
    others: list[tuple[SamplingParams, int | None]],
    pos: int,
    target_kwargs: dict | None = None,
):
    """Sample `steps` tokens for a seeded request placed at `pos` among `others`."""
    kwargs = target_kwargs if target_kwargs is not None else {"temperature": 1.3, "top_p": 0.9}
    target = _params(sampling_seed=seed, **kwargs)
    generators = [make_generator(s, "cpu") if s is not None else None for _, s in others]
    generators.insert(pos, make_generator(seed, "cpu"))
    params = [p for p, _ in others]
    params.insert(pos, target)
    sampler = Sampler(123)
    tokens = []
    for step in range(steps):
        logits = _random_logits(1, seed=1000 + step).repeat(len(params), 1)
        tokens.append(int(sampler(logits, _info(params, generators=generators))[pos]))
    return tokens


def test_seeded_sampling_reproducible_and_independent_of_batch():
    alone = _run_seeded(42, 40, [], 0)
    assert alone == _run_seeded(42, 40, [], 0)
    others = [
        (_params(temperature=0.7), None),
        (_params(top_k=3, sampling_seed=9), 9),
        (_params(temperature=0.0), None),
        (_params(min_p=0.1, sampling_seed=1), 1),
    ]
    assert alone == _run_seeded(42, 40, others, 0)
    assert alone == _run_seeded(42, 40, others, 2)
    assert alone == _run_seeded(42, 40, others[:1], 1)


def test_seeded_plain_row_unaffected_by_filters_of_other_rows():
    # The batch takes the top-k/top-p path because of the other row; the plain row must not
    # notice (its probabilities are not even renormalised).
    alone = _run_seeded(7, 60, [], 0, target_kwargs={})
    others = [(_params(top_k=2, top_p=0.5), None)]
    assert alone == _run_seeded(7, 60, others, 1, target_kwargs={})


def test_different_seeds_differ():
    assert _run_seeded(1, 40, [], 0) != _run_seeded(2, 40, [], 0)


def test_unseeded_rows_follow_sampler_seed():
    logits = _random_logits(64)
    info = _info([_params()] * 64)
    assert torch.equal(Sampler(5)(logits, info), Sampler(5)(logits, info))
    assert not torch.equal(Sampler(5)(logits, info), Sampler(6)(logits, info))


def _frequencies(params: SamplingParams, rows: int = 4000) -> torch.Tensor:
    info = _info([params] * rows)
    ids = Sampler(0)(_known_logits(rows), info)
    return torch.bincount(ids, minlength=VOCAB).float() / rows


@pytest.mark.parametrize(
    "kwargs, support",
    [
        ({}, [0, 1, 2, 3, 4]),
        ({"top_k": 2}, [0, 1]),
        ({"top_k": 4}, [0, 1, 2, 3]),
        ({"top_p": 0.65}, [0, 1]),
        ({"top_p": 0.75}, [0, 1, 2]),
        ({"top_p": 0.1}, [0]),
        ({"min_p": 0.3}, [0, 1, 2]),
        ({"min_p": 0.5}, [0, 1]),
        # top-p applies to the distribution renormalised after top-k: [.47, .35, .18].
        ({"top_k": 3, "top_p": 0.8}, [0, 1]),
        ({"top_k": 4, "min_p": 0.3}, [0, 1, 2]),
    ],
)
def test_filters_restrict_support(kwargs, support):
    freq = _frequencies(_params(**kwargs))
    assert set(torch.nonzero(freq).flatten().tolist()) == set(support)
    expected = torch.tensor([KNOWN_PROBS[i] for i in support])
    expected = expected / expected.sum()
    assert torch.allclose(freq[support], expected, atol=0.04)


def test_temperature_reshapes_distribution():
    freq = _frequencies(_params(temperature=0.5), rows=8000)
    expected = torch.tensor(KNOWN_PROBS) ** 2
    assert torch.allclose(freq[:5], expected / expected.sum(), atol=0.03)


def test_no_penalty_tensors_for_default_params():
    info = _info([_params(), _params(temperature=0.5)], outputs=[[1, 1], [2]], inputs=[[3], [4]])
    assert not info.has_penalties
    assert info.output_counts is None and info.repetition_scales is None
    assert info.min_tokens_block is None


def test_frequency_and_presence_penalties_exact():
    params = [_params(frequency_penalty=0.5, presence_penalty=0.3), _params()]
    info = _info(params, outputs=[[1, 1, 3], [1, 1]], inputs=[[5], [6]])
    logits = _random_logits(2)
    expected = logits.clone()
    expected[0, 1] -= 0.5 * 2 + 0.3
    expected[0, 3] -= 0.5 * 1 + 0.3
    info.apply_penalties_(logits)
    assert torch.allclose(logits, expected, atol=1e-6, rtol=0)


def test_repetition_penalty_exact_over_prompt_and_output():
    params = [_params(repetition_penalty=1.5), _params()]
    info = _info(params, outputs=[[1], [1]], inputs=[[2, 2], [3]])
    logits = torch.zeros(2, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 4] = 3.0, -2.0, 1.0
    logits[1, 1], logits[1, 3] = 3.0, -2.0
    expected = logits.clone()
    expected[0, 1], expected[0, 2] = 3.0 / 1.5, -2.0 * 1.5
    info.apply_penalties_(logits)
    assert torch.allclose(logits, expected, atol=1e-6, rtol=0)


def test_penalty_order_repetition_then_frequency():
    info = _info([_params(repetition_penalty=2.0, frequency_penalty=1.0)], outputs=[[0]])
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 4.0
    info.apply_penalties_(logits)
    assert logits[0, 0].item() == pytest.approx(4.0 / 2.0 - 1.0)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_new_tokens_blocks_eos_and_stop_ids_then_releases(ignore_eos):
    params = _params(min_new_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos)
    greedy = _params(temperature=0.0, min_new_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos)
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 7], logits[0, 9] = 5.0, 4.0, 3.0  # 2 is eos
    sampler = Sampler(0)
    outputs: list[int] = []
    for step in range(4):
        info = _info([params], outputs=[list(outputs)], eos=[{2}])
        blocked = logits.clone()
        info.apply_penalties_(blocked)
        if step < 3:
            assert blocked[0, 7] == -math.inf
            assert (blocked[0, 2] == -math.inf) != ignore_eos
        else:
            assert info.min_tokens_block is None and torch.equal(blocked, logits)
        greedy_info = _info([greedy], outputs=[list(outputs)], eos=[{2}])
        outputs.append(int(sampler(logits, greedy_info)[0]))
    expected_early = 2 if ignore_eos else 9
    assert outputs == [expected_early] * 3 + [2]


def test_empty_batch():
    info = _info([])
    assert Sampler(0)(torch.zeros(0, VOCAB), info).shape == (0,)


def test_token_logprobs():
    logits = _random_logits(3)
    ids = torch.tensor([0, 5, 31])
    expected = torch.log_softmax(logits, -1)[torch.arange(3), ids]
    assert torch.allclose(get_token_logprobs(logits, ids), expected)
    assert get_token_logprobs(logits.half(), ids).dtype == torch.float32


def test_top_logprobs():
    logits = _random_logits(3)
    result = get_top_logprobs(logits, [0, 2, 3])
    assert result[0] == ([], [])
    logprobs = torch.log_softmax(logits, -1)
    for row, n in ((1, 2), (2, 3)):
        values, ids = result[row]
        ref_values, ref_ids = logprobs[row].topk(n)
        assert ids == ref_ids.tolist()
        assert values == pytest.approx(ref_values.tolist())
    assert get_top_logprobs(logits, [0, 0, 0]) == [([], [])] * 3
