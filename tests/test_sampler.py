import pytest
import torch

from moefit.runtime.sampler import Sampler, SamplingParams, choice_seed, uniform

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


def whole_sort_nucleus(probs, top_p):
    """The nucleus as the sampler made it before: the whole vocabulary sorted (ties in vocabulary order)."""
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    return torch.zeros_like(probs).scatter(0, order, sorted_p * keep)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0, 30.0])
def test_the_nucleus_read_from_the_head_is_the_whole_sorts(scale):
    """_top_p sorts only the tokens above a floor where they hold the mass: the same tokens and
    values as sorting a 151,936-word vocabulary, peaked (the head path) or flat (the whole sort),
    ties across the floor included."""
    from moefit.runtime.sampler import _top_p
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(151936, generator=g) * scale
    logits[1000:1400] = logits.max() - 4.0                        # a run of ties near the head
    probs = torch.softmax(logits, -1)
    for top_p in (0.3, 0.8, 0.9, 0.95, 0.999):
        assert torch.equal(_top_p(probs, top_p), whole_sort_nucleus(probs, top_p)), top_p


def test_a_greedy_draw_reads_the_token_probs_found():
    """Greedy: draw gives the argmax probs() found, and of any other distribution its argmax."""
    s = Sampler(SamplingParams(temperature=0), [], 6)
    probs = s.probs(torch.tensor([0.1, 3.0, 2.0, -1.0, 3.5, 0.0]))
    assert s.draw(probs) == 4 and torch.equal(probs, torch.nn.functional.one_hot(torch.tensor(4), 6).float())
    assert s.draw(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])) == 2


def test_a_choices_seed_starts_a_stream_of_its_own():
    """Choice 0 keeps the request's seed; the others' streams share no stretch with it (a seed
    of seed + k * golden would be the same stream shifted by k)."""
    assert choice_seed(None, 2) is None and choice_seed(7, 0) == 7 and choice_seed(-3, 0) == -3
    seeds = [choice_seed(7, i) for i in range(16)] + [choice_seed(-3, 1), choice_seed(2**64 - 1, 1)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**64 for s in seeds[1:])
    first = [uniform(7, i) for i in range(64)]
    for s in seeds[1:16]:
        assert not set(first) & {uniform(s, i) for i in range(64)}


def test_a_logit_bias_bans_or_forces_a_token_greedy_or_sampled():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    banned = SamplingParams(temperature=0, logit_bias=((1, -100.0),))
    assert Sampler(banned, [0], 4).next(logits) == 3
    for seed in range(8):
        forced = SamplingParams(temperature=1.0, seed=seed, logit_bias=((0, 100.0),))
        assert Sampler(forced, [0], 4).next(logits) == 0
    nudged = Sampler(SamplingParams(temperature=1.0, logit_bias=((2, 1.0),)), [0], 4).probs(logits)
    assert nudged[2] == pytest.approx(nudged[3])                       # 1 + 1 against 2
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),)).check()
