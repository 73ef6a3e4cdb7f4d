"""The distributed pieces without Ray: wire messages, actors driven in-process, overlap.

`LocalEndpoint` runs each actor call at once in this process, so the
coordinator, the message codec and the draft's speculative next tree are
checked here fast and exactly; tests/test_cluster.py repeats the end-to-end
checks on real Ray actors.
"""

import dataclasses

import numpy as np
import pytest
from fixtures import noisy_copy, tiny_pair
from test_cluster import GREEDY, MAX_LEN, SPEC

from specdec import LLM, SamplingParams
from specdec.cluster import messages as m
from specdec.cluster.actors import DraftActor, StaleIncarnation, TargetActor
from specdec.cluster.config import ClusterConfig, GroupConfig
from specdec.cluster.remote import LocalEndpoint, RemoteDrafter, RemoteTarget, WorkerDown
from specdec.draft.base import DraftBatch
from specdec.draft.model import greedy_chain
from specdec.engine import LLMEngine
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

# ----------------------------------------------------------------------------- messages


def test_tree_message_roundtrip_pads_rows():
    batch = DraftBatch.empty(3, 4)
    batch.tokens[0, :3] = [17, 42, 5]
    batch.parents[0, :3] = [-1, -1, 0]
    batch.tokens[2, :4] = [1, 2, 3, 4]
    batch.parents[2, :4] = [-1, 0, 1, 2]
    active = np.array([True, False, True])
    data = m.pack_tree(7, batch, active, {"hits": 1})
    got, stats = m.unpack_tree(data, 7, num_slots=3, max_nodes=4, vocab_size=50)
    assert stats == {"hits": 1}
    np.testing.assert_array_equal(got.tokens, batch.tokens)
    np.testing.assert_array_equal(got.parents, batch.parents)  # padding -2 restored
    assert got.child_sampling is ChildSampling.DETERMINISTIC_TOPK and got.draft_probs is None
    with pytest.raises(m.MessageError, match="round 7, expected 8"):
        m.unpack_tree(data, 8, num_slots=3, max_nodes=4, vocab_size=50)
    with pytest.raises(m.MessageError, match="pads to 4 nodes, expected 6"):
        m.unpack_tree(data, 7, num_slots=3, max_nodes=6, vocab_size=50)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.unpack_tree(data, 7, num_slots=3, max_nodes=4, vocab_size=40)


def test_verdict_and_sampling_roundtrip():
    emitted = np.array([[3, 4, -1], [9, -1, -1]], np.int32)
    num, acc = np.array([1, 0], np.int32), np.array([[0, -1], [-1, -1]], np.int32)
    e2, n2, a2 = m.unpack_verdict(m.pack_verdict(3, emitted, num, acc), 3)
    for x, y in ((emitted, e2), (num, n2), (acc, a2)):
        np.testing.assert_array_equal(x, y)
        assert y.dtype == np.int32
    s = SamplingBatch.make_dummy(2)
    s.temperature[1] = 0.7
    s.seed[0] = 2**32 - 1
    back = m.sampling_from(m.unpack(m.pack("x", 1, **m.sampling_fields(s)), "x"))
    for k in ("temperature", "top_k", "top_p", "min_p", "seed", "counter"):
        np.testing.assert_array_equal(getattr(s, k), getattr(back, k))
        assert getattr(back, k).dtype == getattr(s, k).dtype
    assert back.seen is None and back.repetition_penalty is None
    seen = np.zeros((2, 40), bool)
    seen[1, [3, 39]] = True
    s = dataclasses.replace(s, repetition_penalty=np.array([1.0, 1.3], np.float32), seen=seen)
    back = m.sampling_from(m.unpack(m.pack("x", 1, **m.sampling_fields(s)), "x"))
    np.testing.assert_array_equal(back.seen, seen)
    np.testing.assert_array_equal(back.repetition_penalty, s.repetition_penalty)
    with pytest.raises(m.MessageError, match="expected a 'verdict' message"):
        m.unpack_verdict(m.pack("ack", 3), 3)
    with pytest.raises(m.MessageError, match="not a msgpack message"):
        m.unpack(b"\xc1", "ack")


def test_greedy_chain_by_hand():
    # Row 0: root -> 0 -> 2 -> 4 (first children); row 1: padding only.
    parents = np.array([[-1, -1, 0, 0, 2], [-2, -2, -2, -2, -2]], np.int32)
    chain, length = greedy_chain(parents)
    assert length.tolist() == [3, 0]
    assert chain[0, :3].tolist() == [0, 2, 4] and (chain[1] == -1).all()


def test_config_validation():
    with pytest.raises(ValueError, match="resources must be a non-empty map"):
        GroupConfig({})
    with pytest.raises(ValueError, match="max_restarts must be"):
        GroupConfig({"CPU": 1}, max_restarts=-2)
    with pytest.raises(ValueError, match="tpu_topology and accelerator_version go together"):
        GroupConfig({"TPU": 4}, tpu_topology="2x2")
    cc = ClusterConfig.local_cpu(target_devices=4)
    assert cc.target.env_vars["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert cc.target.resources == {"target_group": 1} and cc.draft.num_devices == 1
    assert GroupConfig({"TPU": 4}, num_hosts=4).placement_strategy == "STRICT_SPREAD"


# ----------------------------------------------------------------------------- in-process actors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_pair(tmp_path_factory.mktemp("target"))
    return target, noisy_copy(target, tmp_path_factory.mktemp("x") / "draft", noise=0.05)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in rng.integers(1, 40, 16)]


@pytest.fixture(scope="module")
def spec(models):
    return {"method": "draft_model", "model": str(models[1]), **SPEC}


def local_engine(models, spec, overlap):
    dw = DraftActor(spec, target_model=str(models[0]), dtype="float32", num_slots=8,
                     max_model_len=MAX_LEN)  # fmt: skip
    drafter = RemoteDrafter(LocalEndpoint("draft", [dw]), num_slots=8, vocab_size=320,
                            overlap=overlap)  # fmt: skip
    tw = TargetActor(str(models[0]), dtype="float32", num_slots=8, max_model_len=MAX_LEN,
                      max_tree_nodes=drafter.max_nodes)  # fmt: skip
    target = RemoteTarget(LocalEndpoint("target", [tw]), num_slots=8,
                          max_tree_nodes=drafter.max_nodes, vocab_size=320)  # fmt: skip
    return LLMEngine(target, None, max_num_seqs=8, max_model_len=MAX_LEN, drafter=drafter,
                     vocab_size=320)  # fmt: skip


def run(engine, prompts, params):
    seqs = [engine.add_request(str(i), None, p["prompt_token_ids"], params)
            for i, p in enumerate(prompts)]  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    return [s.output_ids for s in seqs], engine.spec_metrics.as_dict()


SEEDED = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=5, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"]
)
def test_remote_proxies_equal_in_process(models, spec, prompts, params):
    llm = LLM(models[0], max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec)
    ref, ref_metrics = run(llm.engine, prompts, params)
    for overlap in (False, True):
        engine = local_engine(models, spec, overlap)
        out, metrics = run(engine, prompts, params)
        assert out == ref
        stats = engine.drafter.overlap_stats()
        if overlap:
            assert stats["misses"] > 0  # rollbacks happened, and changed nothing
            # Sampled and penalised runs rarely hit (the draft guesses unpenalised).
            assert stats["hits"] > 0 or params.temperature > 0 or params.repetition_penalty != 1
            print(f"\n{params.temperature=}: overlap hit rate {stats['hit_rate']:.2f}")
        else:
            assert stats["hits"] == stats["misses"] == 0
        # A hit reuses exactly the tree the draft would have grown afterwards (under a
        # repetition penalty too: the speculated tree counts the guessed run as seen).
        assert metrics["acceptance_length"] == pytest.approx(ref_metrics["acceptance_length"])


def test_stale_incarnation_and_old_rounds_are_refused(models, spec):
    engine = local_engine(models, spec, overlap=True)
    target = engine.target
    msg = m.pack("release", 5, incarnation="an-earlier-actor", slot=0)
    with pytest.raises(WorkerDown, match="restarted"):
        target.endpoint.result(target.endpoint.submit("release", msg))
    actor = target.endpoint.handles[0]
    with pytest.raises(StaleIncarnation):
        actor.release(msg)
    actor.release(m.pack("release", 5, incarnation=target.incarnation, slot=0))
    with pytest.raises(m.MessageError, match="round 4 after round 5"):
        actor.release(m.pack("release", 4, incarnation=target.incarnation, slot=0))


@pytest.mark.slow
def test_remote_workers_hold_the_engines_reservations(models, spec, prompts):
    """Planned lengths reach both actors with the prefill / start (and a restore), so a
    remote request reads one compiled K/V length from start to end, as in-process."""
    engine = local_engine(models, spec, overlap=False)
    ref = LLM(models[0], max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec).engine
    for e in (engine, ref):
        for i, p in enumerate(prompts[:3]):
            e.add_request(str(i), None, p["prompt_token_ids"], GREEDY)
        e.step()
    tw = engine.target.endpoint.handles[0].worker
    dw = engine.drafter.endpoint.handles[0].drafter
    want = ref.target.runner.reserved
    assert want[:3].min() > 0 and not want[3:].any()
    np.testing.assert_array_equal(tw.runner.reserved, want)
    np.testing.assert_array_equal(dw.runner.reserved, ref.drafter.runner.reserved)
    # A restarted target gets them back with its histories.
    actor = engine.target.endpoint.handles[0]
    slots = sorted(engine.target.history)
    histories = [engine.target.history[s] for s in slots]
    msg = m.pack("restore", engine.target.round, incarnation=engine.target.incarnation,
                 slots=slots, histories=histories,
                 reserve=[engine.target.reserved[s] for s in slots])  # fmt: skip
    actor.restore(msg)
    np.testing.assert_array_equal(tw.runner.reserved, want)
    with pytest.raises(m.MessageError, match="'reserve' must be a list of 3 lengths"):
        actor.restore(m.pack("restore", engine.target.round, incarnation=engine.target.incarnation,
                             slots=slots, histories=histories, reserve=[1]))  # fmt: skip
    engine.target.release(0)
    assert 0 not in engine.target.reserved


def test_auto_dtype_is_decided_in_each_actor(models, spec, monkeypatch):
    """dtype="auto" travels to the actors: each times its products on its own host, for
    the rows a lone request's step verifies (`plan.PLAN_SLOTS`), and the target reports
    what it chose."""
    import jax.numpy as jnp

    import specdec.plan as plan
    from specdec.params import SpeculativeConfig

    asked = []

    def fake(folder, requested="auto", *, rows=None):
        asked.append((str(folder), rows))
        return "bfloat16"

    monkeypatch.setattr(plan, "resolve_dtype", fake)
    dw = DraftActor(spec, target_model=str(models[0]), dtype="auto", num_slots=2,
                     max_model_len=MAX_LEN)  # fmt: skip
    n = dw.drafter.max_nodes
    tw = TargetActor(str(models[0]), dtype="auto", num_slots=2, max_model_len=MAX_LEN,
                      max_tree_nodes=n)  # fmt: skip
    rows = plan.dtype_rows(plan.verify_rows(SpeculativeConfig.from_dict(spec), 1), 2)
    assert asked == [(str(models[0]), rows), (str(models[0]), plan.dtype_rows(1 + n, 2))]
    assert rows == (1 + n, 2 * (1 + n))  # one running request, and a batch of both slots
    assert m.unpack(tw.hello(), "hello")["dtype"] == "bfloat16"
    assert tw.worker.runner.params["embed"].dtype == jnp.bfloat16
    assert dw.drafter.runner.params["embed"].dtype == jnp.bfloat16
