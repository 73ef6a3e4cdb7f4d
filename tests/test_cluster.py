"""Draft and target as Ray actors: exactness (sharded and not), overlap, faults.

Needs loopback-only networking (CI runs pytest inside `unshare -n`); starts and
stops its own Ray instance. Figures (hit rate, recovery times) are printed: run
with `-s` to see them.
"""

import os

# Ray reads the auth mode when it is imported; the head it starts must agree (explicit).
os.environ.setdefault("RAY_AUTH_MODE", "token")

import dataclasses  # noqa: E402
import time  # noqa: E402

import numpy as np
import pytest
from fixtures import noisy_copy, tiny_pair

from specdec import LLM, SamplingParams
from specdec.cluster.config import ClusterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Ray cluster: CI, not the quick subset

ray = pytest.importorskip("ray")

MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPEC = dict(num_speculative_tokens=10, max_depth=4, topk=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_pair(tmp_path_factory.mktemp("target"))
    draft = noisy_copy(target, tmp_path_factory.mktemp("x") / "draft", noise=0.05)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in rng.integers(1, 40, 24)]


@pytest.fixture(scope="module")
def spec(models):
    return {"method": "draft_model", "model": str(models[1]), **SPEC}


@pytest.fixture(scope="module")
def reference(models, prompts, spec):
    """In-process engine, unsharded target, same drafter."""
    llm = LLM(models[0], max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    ray.init(
        num_cpus=2,
        resources={"target_group": 2, "draft_group": 2},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}},
    )
    yield tmp_path_factory.mktemp("xla_cache")
    ray.shutdown()


def config(cache_dir, target_devices=4, **kw) -> ClusterConfig:
    """CPU groups; a shared XLA cache so restarted actors do not compile from scratch."""
    cc = ClusterConfig.local_cpu(target_devices=target_devices, **kw)
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return dataclasses.replace(
        cc,
        target=dataclasses.replace(cc.target, env_vars={**cc.target.env_vars, **env}),
        draft=dataclasses.replace(cc.draft, env_vars={**cc.draft.env_vars, **env}),
    )


@pytest.fixture(scope="module")
def sharded(ray_session, models, spec):
    """Target over 4 virtual CPU devices, draft on its own group, overlap on."""
    llm = LLM(
        models[0], cluster=config(ray_session, 4), max_model_len=MAX_LEN, max_num_seqs=8,
        speculative_config=spec,
    )  # fmt: skip
    yield llm
    llm.engine.target.cluster.shutdown()


def drive(llm, prompts, params, at_step=None, action=None):
    """The engine's step loop by hand, calling `action` after step `at_step`."""
    seqs = [
        llm.engine.add_request(str(i), None, p["prompt_token_ids"], params)
        for i, p in enumerate(prompts)
    ]
    step = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        step += 1
        if step == at_step:
            action()
    return [s.output().outputs[0] for s in seqs]


def test_sharded_distributed_equals_in_process(sharded, prompts, reference):
    info = sharded.engine.target.info
    assert info["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert info["placement"]["wq"] == "split heads / 4"
    assert info["placement"]["wk"] == "replicated"  # 2 K/V heads do not split 4 ways
    assert sharded.engine.drafter.info["pid"] != info["pid"]
    assert info["dtype"] == sharded.dtype == "float32"  # "auto", decided in the actor
    t0 = time.perf_counter()
    out = [o.outputs[0].token_ids for o in sharded.generate(prompts, GREEDY, use_tqdm=False)]
    print(f"\ndistributed, target on 4 devices: {time.perf_counter() - t0:.1f} s")
    assert out == reference  # == the in-process engine's output (unsharded target)
    assert sharded.get_metrics()["acceptance_length"] > 2


def test_megakernel_target_group_equals_in_process(ray_session, models, spec, prompts, reference):
    """The target actor on a 4-device group runs the megakernel split 4 ways (interpret
    mode here): the same tokens as the in-process, one-device XLA engine."""
    llm = LLM(
        models[0], cluster=config(ray_session, 4), max_model_len=MAX_LEN, max_num_seqs=8,
        speculative_config=spec, kernel="megakernel",
    )  # fmt: skip
    try:
        info = llm.engine.target.info
        assert info["kernel"] == "megakernel" and len(info["devices"]) == 4
        assert info["placement"]["wk"] == "split kv_heads / 4"  # 2 K/V heads repeated to 4
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert out == reference
    finally:
        llm.engine.target.cluster.shutdown()


def test_overlap_on_off_identical(sharded, prompts, reference):
    drafter = sharded.engine.drafter
    figures = {}
    for overlap in (False, True):
        drafter.overlap = overlap
        before = drafter.overlap_stats()
        t0 = time.perf_counter()
        outs = sharded.generate(prompts, GREEDY, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert [o.outputs[0].token_ids for o in outs] == reference
        after = drafter.overlap_stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        figures[overlap] = (hits, misses, tokens / dt)
    hits, misses, _ = figures[True]
    print(
        f"\noverlap off: {figures[False][2]:.0f} tok/s; on: {figures[True][2]:.0f} tok/s, "
        f"hit rate {hits / (hits + misses):.2f} ({hits} hits, {misses} misses)"
    )
    assert figures[False][:2] == (0, 0)
    assert hits > 0 and misses > 0  # the noisy draft exercises both the reuse and the rollback


def test_draft_killed_mid_generation(sharded, prompts, reference):
    drafter = sharded.engine.drafter
    drafter.overlap = True
    victim = drafter.endpoint.handles[0]
    out = drive(sharded, prompts, GREEDY, 3, lambda: ray.kill(victim, no_restart=False))
    assert [o.token_ids for o in out] == reference
    assert drafter.target_only_steps > 0  # decoded target-only while the draft restarted
    for _ in range(20):  # the restarted draft is re-prefilled and drafts again
        if drafter.recoveries:
            break
        out = sharded.generate(prompts[:8], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == reference[:8]
    print(f"\ndraft recovery: {drafter.recoveries[0]:.2f} s "
          f"({drafter.target_only_steps} steps decoded target-only)")  # fmt: skip
    before = sharded.get_metrics()["num_drafts"]
    out = sharded.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference[:8]
    assert sharded.get_metrics()["num_drafts"] > before


def test_target_killed_mid_generation(sharded, prompts, reference):
    target = sharded.engine.target
    victim = target.endpoint.handles[0]
    out = drive(sharded, prompts, GREEDY, 3, lambda: ray.kill(victim, no_restart=False))
    assert [o.token_ids for o in out] == reference
    assert len(target.recoveries) == 1
    print(f"\ntarget recovery (restart + re-prefill): {target.recoveries[0]:.2f} s")


def test_restarts_exhausted(ray_session, models, spec, prompts, reference):
    llm = LLM(
        models[0], cluster=config(ray_session, 1, max_restarts=0), max_model_len=MAX_LEN,
        max_num_seqs=8, speculative_config=spec,
    )  # fmt: skip
    try:
        few, ref = prompts[:12], reference[:12]
        # Draft gone for good: target-only from then on, output unchanged.
        draft = llm.engine.drafter.endpoint.handles[0]
        out = drive(llm, few, GREEDY, 2, lambda: ray.kill(draft, no_restart=False))
        assert [o.token_ids for o in out] == ref
        assert llm.engine.drafter.dead
        # Target gone for good: partial outputs, finish_reason="error", a clear error.
        target = llm.engine.target.endpoint.handles[0]
        out = drive(llm, few, GREEDY, 2, lambda: ray.kill(target, no_restart=False))
        assert all(o.finish_reason == "error" for o in out)
        assert any(o.token_ids for o in out)
        for o, r in zip(out, ref, strict=True):
            assert o.token_ids == r[: len(o.token_ids)]  # committed tokens are kept
        msg = str(llm.engine.last_error)
        print(f"\n{msg}")
        assert "target actor 'specdec-target'" in msg and "max_restarts=0" in msg
        assert "committed tokens are kept" in msg
        # Later calls return at once with the same verdict instead of hanging.
        later = llm.generate(few[:2], GREEDY, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in later] == ["error", "error"]
    finally:
        llm.engine.target.cluster.shutdown()


def test_actor_that_cannot_start_names_the_cause(ray_session, models, tmp_path):
    bad = {"method": "draft_model", "model": str(tmp_path / "missing"), **SPEC}
    before = ray.available_resources()
    with pytest.raises(
        RuntimeError, match=r"specdec-draft actor did not start: .*Draft model path"
    ):
        LLM(models[0], cluster=config(ray_session, 1), max_model_len=MAX_LEN, max_num_seqs=8,
            speculative_config=bad)  # fmt: skip
    time.sleep(1)  # resource accounting catches up
    after = ray.available_resources()
    for group in ("draft_group", "target_group"):  # placement groups released
        assert after.get(group, 0) >= before.get(group, 0)
