import pytest
import torch

from moefit.runtime.sampler import Sampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def draws(params, n=400, prompt=(), logits=LOGITS):
    """n tokens as the decode loop takes them: draw, then accept (the next position)."""
    s = Sampler(params, list(prompt), len(logits))
    out = []
    for _ in range(n):
        out.append(s.next(logits))
        s.accept(out[-1])
    return out


def test_greedy_is_the_argmax():
    assert set(draws(SamplingParams(temperature=0), 10)) == {0}


def test_a_seed_reproduces_the_draws():
    p = SamplingParams(temperature=1.0, seed=3)
    assert draws(p) == draws(p) != draws(SamplingParams(temperature=1.0, seed=4))


def test_top_k_and_top_p_restrict_the_support():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=0))) == {0, 1}
    probs = torch.softmax(LOGITS, -1)                    # 0.55, 0.20, 0.12, 0.07, 0.03
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0))) == {0, 1}
    assert probs[0] + probs[1] > 0.7


def test_min_p_drops_tokens_far_below_the_best():
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3, seed=0))) == {0, 1}


def test_penalties_push_seen_tokens_down():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0), [0], 5)
    assert s.next(LOGITS) == 1
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=2.0), [], 5)
    s.accept(0)
    assert s.next(LOGITS) == 1


def test_sampling_follows_the_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=1), 4000)), minlength=5)
    assert torch.allclose(counts / 4000, torch.softmax(LOGITS, -1), atol=0.03)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("min_p", 2), ("max_tokens", 0)])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).check()
