"""The step loop's logic on a mock target and drafter (tests/mock_engine.py): outputs,
stop rules inside an accepted run, slots, metrics. Every expected value is worked
out by hand from `next_token(t) = (3 t + 1) % V`."""

import numpy as np
import pytest
from mock_engine import MockDrafter, MockTarget, next_token

from specdec.engine import LLMEngine
from specdec.params import SamplingParams

V = 100


def rule(last: int, n: int) -> list[int]:
    """The n tokens the mock target writes after `last`."""
    out = []
    for _ in range(n):
        last = next_token(last, V)
        out.append(last)
    return out


def engine(slots=2, depth=4, wrong_at=3, eos=(), drafter=True, max_len=64):
    target = MockTarget(V, slots)
    draft = MockDrafter(V, slots, depth, wrong_at) if drafter else None
    return LLMEngine(target, None, max_num_seqs=slots, max_model_len=max_len,
                     eos_token_ids=eos, drafter=draft, vocab_size=V)  # fmt: skip


def run(eng: LLMEngine, prompts, params) -> list:
    seqs = [eng.add_request(str(i), None, p, params) for i, p in enumerate(prompts)]
    while eng.has_unfinished_requests():
        eng.step()
    return seqs


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **({"max_tokens": 10} | kw))


def test_rule_worked_by_hand():
    assert rule(4, 4) == [13, 40, 21, 64]  # 3*4+1, 3*13+1, 3*40+1 = 121 % 100, 3*21+1


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "plain"])
def test_outputs_follow_the_rule_with_and_without_speculation(drafter):
    eng = engine(drafter=drafter)
    seqs = run(eng, [[4], [7, 8], [1, 2, 3]], greedy(max_tokens=10))
    for seq, last in zip(seqs, (4, 8, 3), strict=True):
        assert seq.output_ids == rule(last, 10)
        assert seq.finish_reason == "length"


def test_each_step_emits_the_accepted_run_and_the_bonus_token():
    """wrong_at=3: 2 accepted + 1 bonus = 3 tokens a step after the prefill's first."""
    eng = engine(slots=1, depth=4, wrong_at=3)
    (seq,) = run(eng, [[4]], greedy(max_tokens=7))  # 1 (prefill) + 3 + 3
    m = seq.metrics.spec
    assert seq.output_ids == rule(4, 7)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (2, 16, 4)
    assert m.acceptance_length == 3.0 and m.acceptance_rate == 4 / 16
    assert m.per_position_acceptance_rate == [1.0, 1.0]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 8])
def test_max_tokens_is_never_exceeded_inside_an_accepted_run(max_tokens):
    eng = engine(slots=1, depth=6, wrong_at=6)  # 6 tokens a step
    (seq,) = run(eng, [[4]], greedy(max_tokens=max_tokens))
    assert seq.output_ids == rule(4, max_tokens) and seq.finish_reason == "length"


def test_stop_token_and_eos_end_the_output_at_the_exact_token():
    out = rule(4, 10)
    eng = engine(slots=1, depth=6, wrong_at=6)
    (seq,) = run(eng, [[4]], greedy(stop_token_ids=[out[3]]))  # mid-run (tokens 2..7)
    assert seq.output_ids == out[:4]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", out[3])
    eng = engine(slots=1, depth=6, wrong_at=6, eos=(out[4],))
    (seq,) = run(eng, [[4]], greedy())
    assert seq.output_ids == out[:5] and seq.finish_reason == "stop"
    eng = engine(slots=1, depth=6, wrong_at=6, eos=(out[4],))
    (seq,) = run(eng, [[4]], greedy(ignore_eos=True))
    assert seq.output_ids == out


def test_max_model_len_ends_a_request_inside_a_run():
    eng = engine(slots=1, depth=6, wrong_at=6, max_len=9)
    (seq,) = run(eng, [[1, 2, 3, 4]], greedy(max_tokens=50))
    assert seq.output_ids == rule(4, 5) and seq.finish_reason == "length"  # 4 + 5 = 9


def test_more_requests_than_slots_queue_and_reuse_freed_slots():
    eng = engine(slots=2)
    prompts = [[i + 1] for i in range(5)]
    seqs = run(eng, prompts, greedy(max_tokens=4))
    assert [s.output_ids for s in seqs] == [rule(p[0], 4) for p in prompts]
    target, drafter = eng.target, eng.drafter
    # 1 token from the prefill + 3 from one step = 4: each pair ends after one step.
    assert target.prefills == [[0, 1], [0, 1], [0]]  # admitted as slots free up
    assert target.released == [0, 1, 0, 1, 0]
    assert sorted(drafter.started) == sorted(s for p in target.prefills for s in p)
    assert not eng.has_unfinished_requests() and all(s is None for s in eng.slots)


def test_a_request_finishing_at_its_first_token_never_reaches_the_drafter():
    eng = engine(slots=2)
    seqs = run(eng, [[4], [5]], greedy(max_tokens=1))
    assert [s.output_ids for s in seqs] == [rule(4, 1), rule(5, 1)]
    assert eng.drafter.started == [] and eng.drafter.commits == 0


def test_engine_metrics_sum_the_requests():
    eng = engine(slots=2, depth=4, wrong_at=2)  # 1 accepted + bonus: 2 tokens a step
    seqs = run(eng, [[4], [9]], greedy(max_tokens=5))  # 1 + 2 + 2
    for s in seqs:
        assert s.metrics.spec.num_drafts == 2 and s.metrics.spec.acceptance_length == 2.0
    total = eng.spec_metrics
    assert (total.num_drafts, total.num_accepted_tokens, total.num_draft_tokens) == (4, 4, 32)
    np.testing.assert_allclose(total.per_position_acceptance_rate, [1.0])
