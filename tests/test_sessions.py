"""--sessions N: N conversations' sequence states held at once, planned and charged on the card.
A request goes to the session it continues; a side request does not overwrite another
conversation's state; output does not depend on which session a prompt ran on."""

import pytest

from moefit.config import ServeConfig
from moefit.errors import UsageError
from moefit.memory import ledger as L
from moefit.runtime.engine import PAUSE, Engine
from moefit.runtime.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
MAIN = [5, 9, 17, 33, 65, 129, 7, 3, 150, 220, 31, 64] * 4               # a long system prompt and a task
SIDE = [5, 9, 201, 202, 203, 204, 205, 206]                              # shares two tokens with it


def turns(engine):
    """Main turn, a side request, the main conversation's next turn, the side's next turn."""
    main = engine.generate(MAIN, GREEDY)[1].generated
    side = engine.generate(SIDE, GREEDY)[1].generated
    main2 = engine.generate(MAIN + main + [11, 12], GREEDY)[1]
    side2 = engine.generate(SIDE + side + [13], GREEDY)[1]
    return main, side, main2, side2


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_two_conversations_interleaved_each_resume_where_they_were(family, packs):
    pack = packs(family)
    main, side, main2, side2 = turns(Engine.open(pack, ServeConfig(ctx=128, sessions=2)))
    assert main2.cached_tokens == len(MAIN) + len(main) - 1
    assert side2.cached_tokens == len(SIDE) + len(side) - 1
    one = turns(Engine.open(pack, ServeConfig(ctx=128)))                  # one session: the side request took it
    assert one[2].cached_tokens <= 2
    assert (one[0], one[1], one[2].generated, one[3].generated) == (main, side, main2.generated, side2.generated)


def stepped_in_turn(engine, prompts, params) -> list[list[int]]:
    """Each prompt on a session of its own, their streams' steps (prefill chunks, decode steps,
    windows) taken in turn, as serve's worker takes them."""
    streams = [engine.stream(p, params, session=engine.sessions[i], pauses=True) for i, p in enumerate(prompts)]
    live, engine.pauses = list(range(len(streams))), [0] * len(prompts)
    while live:
        for i in list(live):
            event = next(streams[i], None)
            if event is None:
                live.remove(i)
            engine.pauses[i] += event is PAUSE
    return [engine.sessions[i].last.generated for i in range(len(prompts))]


@pytest.mark.parametrize("family,spec", [("qwen3_moe", "lookup"), ("qwen3_5_moe", "lookup"), ("qwen3_next", "off"),
                                         ("gpt_oss", "lookup"), ("deepseek_v3", "lookup")])
def test_requests_stepped_in_turn_give_what_each_gives_alone(family, spec, packs):
    """Two conversations' steps interleaved (a prompt's prefill chunks, decode steps, speculative
    windows with their DeltaNet checkpoints), then their next turns: every token as each alone
    gives it."""
    pack = packs(family)
    for params in (GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)):
        alone = Engine.open(pack, ServeConfig(ctx=128, spec=spec, prefill_chunk=16))
        main, side = (alone.generate(p, params)[1].generated for p in (MAIN, SIDE))
        nexts = [MAIN + main + [11, 12], SIDE + side + [13]]
        want = [alone.generate(p, params)[1].generated for p in nexts]
        engine = Engine.open(pack, ServeConfig(ctx=128, sessions=2, spec=spec, prefill_chunk=16))
        assert stepped_in_turn(engine, [MAIN, SIDE], params) == [main, side] and engine.pauses == [2, 0]
        assert stepped_in_turn(engine, nexts, params) == want
        assert [s.last.cached_tokens for s in engine.sessions] == [len(MAIN) + len(main) - 1, len(SIDE) + len(side) - 1]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_whose_session_is_busy_starts_on_a_copy_of_it(family, params, packs):
    """A sub-agent's prompt sharing the main conversation's while that one generates: placed on
    the free session with a copy of the busy one (fork), it reuses the prefix and gives what it
    gives alone; the main conversation's tokens are unchanged, its steps and the sub-agent's taken
    in turn."""
    pack, system = packs(family), MAIN * 2                               # 96 tokens: past FORK_MIN
    sub = system + [201, 202, 203]
    alone = Engine.open(pack, ServeConfig(ctx=256, spec="lookup"))
    first = alone.generate(system, params)[1].generated
    want = [alone.generate(system + first + [11], params)[1].generated, alone.generate(sub, params)[1].generated]
    engine = Engine.open(pack, ServeConfig(ctx=256, sessions=2, spec="lookup"))
    main = engine.generate(system, params)[1].generated
    own = engine.session
    other = next(x for x in engine.sessions if x is not own)
    assert engine.place(sub, busy=set()) == (own, None) and engine.place(sub, {id(own), id(other)}) is None
    assert engine.place(system[:60] + [99], {id(own)}) == (other, None)  # 60 tokens to save: no copy
    assert engine.place(sub, busy={id(own)}) == (other, own)
    assert engine.fork(own, other) == len(system) + len(main) - 1
    target = other
    streams = [engine.stream(system + main + [11], params, session=own), engine.stream(sub, params, session=target)]
    while any([next(s, None) is not None for s in streams]):
        pass
    assert [own.last.generated, target.last.generated] == want
    assert target.last.cached_tokens >= len(system) and own.last.cached_tokens == len(system) + len(main) - 1


def test_the_worker_starts_a_side_request_on_a_copy_of_the_conversation(packs):
    """serve's worker places a request (Engine.place) and makes the copy: a side request sharing
    a long conversation's system prompt reuses it, and the conversation's session keeps all of it."""
    import asyncio
    from types import SimpleNamespace
    from moefit.serve.metrics import Metrics
    from moefit.serve.worker import Done, Job, Worker
    engine = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=256, sessions=2))
    system = MAIN * 2
    engine.generate(system, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    conversation = list(engine.session.tokens)
    worker = Worker(engine, SimpleNamespace(before_request=lambda: None), Metrics(), max_queue=4)

    async def side():
        job = Job(system + [201, 202], GREEDY, asyncio.get_running_loop())
        worker.submit(job)
        items = []
        while (item := await asyncio.wait_for(job.events.get(), 60)) is not None:
            items.append(item)
        return items
    try:
        done = asyncio.run(side())[-1]
    finally:
        worker.join(5)
    assert isinstance(done, Done) and done.stats.cached_tokens == len(system)
    assert sorted(len(s.tokens) for s in engine.sessions) == [len(system) + 2 + 11, len(conversation)]
    assert any(s.tokens == conversation for s in engine.sessions)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_a_prefill_stopped_between_chunks_leaves_them_to_reuse(family, packs):
    """serve's worker ends a request whose client left at a prefill chunk's end: the chunks run
    stay the session's, and the same prompt again resumes after them and gives what it gives alone."""
    cfg = ServeConfig(ctx=128, prefill_chunk=16)
    want = Engine.open(packs(family), cfg).generate(MAIN, GREEDY)[1].generated
    engine = Engine.open(packs(family), cfg)
    stream = engine.stream(MAIN, GREEDY, pauses=True)
    assert next(stream) is PAUSE and next(stream) is PAUSE               # two chunks of 16 run
    stream.close()
    again = engine.generate(MAIN, GREEDY)[1]
    assert again.cached_tokens == 32 and again.generated == want


def test_a_prompt_goes_where_it_reuses_more_than_it_overwrites(packs):
    engine = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=128, sessions=3))
    engine.generate(MAIN, GREEDY)
    main = engine.session
    engine.generate(SIDE, GREEDY)
    side = engine.session
    assert side is not main                                               # two tokens shared: an empty session
    engine.generate(MAIN[:30] + [99], GREEDY)
    assert engine.session is main                                         # 30 of its 59 tokens: the same one
    engine.generate(MAIN[:10] + [98], GREEDY)                             # 10 of 41: the empty one
    third = engine.session
    assert third not in (main, side)
    engine.generate([250, 251, 252], GREEDY)                              # nothing shared: the one that loses least
    assert engine.session is side and side.tokens[:3] == [250, 251, 252]
    assert engine.sessions[0].tokens[:30] == MAIN[:30]                    # the main conversation's state is intact


def test_sessions_are_planned_and_charged_exactly(packs, card):
    pack = packs("qwen3_5_moe")
    charged = {}
    for n in (1, 3):
        engine = Engine.open(pack, ServeConfig(device=f"sim:{card(64)}", ctx=128, sessions=n, vram_reserve_mib=8))
        charged[n] = engine.loaded.mem.charged[L.KV]
        assert charged[n] == engine.plan.line(L.KV).bytes and len(engine.sessions) == n
    assert charged[3] == 3 * charged[1]
    with pytest.raises(UsageError, match="--sessions 0"):
        Engine.open(pack, ServeConfig(ctx=128, sessions=0))


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_a_prefix_a_sliding_layers_ring_no_longer_holds_is_run_again(device, packs, card):
    """gpt-oss's sliding layers keep rings of window 8 + chunk 16 = 24 slots: after a 40-token
    reply (44 positions written) the ring holds positions 20-43 only, so the prompt again, or its start and part of the
    reply, resumes where every window it needs is still held (here: nowhere, so from 0), not at
    the common prefix: the same greedy tokens as a fresh engine."""
    pack, cfg = packs("gpt_oss", "int4"), {"ctx": 128, "prefill_chunk": 16}
    if device == "sim":
        cfg.update(device=f"sim:{card(256)}", vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0)
    engine, params = Engine.open(pack, ServeConfig(**cfg)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.generate(MAIN[:5], params)[1].generated
    state = engine.session.state
    assert [state.resumable(n) for n in (44, 40, 27, 26, 5)] == [44, 40, 27, 0, 0]    # 26 needs 19, lost
    again = engine.generate(MAIN[:5], params)[1]
    longer = engine.generate(MAIN[:5] + first[:10] + [7], params)[1]
    fresh = Engine.open(pack, ServeConfig(**cfg)).generate(MAIN[:5] + first[:10] + [7], params)[1]
    assert again.generated == first and again.cached_tokens == 0
    assert longer.generated == fresh.generated and longer.cached_tokens == 0
