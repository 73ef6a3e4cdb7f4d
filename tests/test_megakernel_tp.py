"""The verify megakernel split over n devices (`kernels.megakernel.shard`).

Device counts are fixed when JAX starts, so the kernel runs in child processes
(tests/tp_check.py, 8 virtual CPU devices) under the Pallas TPU interpreter with
its race detector on; each compares the n-device kernel with the one-device
reference: accepted paths, bonus tokens, logits and the written K/V.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import tiny_config
from jax.sharding import PartitionSpec as P

from specdec.kernels import sharding
from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture
from specdec.kernels.megakernel import shard

TESTS = Path(__file__).parent
# NPROC sizes XLA's CPU client thread pool (default: the machine's cores): the n kernel
# instances block on each other's DMAs while their callbacks still need the pool, so
# with fewer threads than a few times n they deadlock.
ENV = dict(
    os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
    NPROC="32",
)  # fmt: skip


def tp_check(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "tp_check.py", *args], cwd=TESTS, env=ENV, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "n,mode,hidden,owners",
    [("2", "eager", "256", 2), pytest.param("8", "on_wait", "256", 2, marks=pytest.mark.slow),
     pytest.param("4", "eager", "192", 4, marks=pytest.mark.slow),
     ("4", "eager", "384", 3)],
)  # fmt: skip
def test_collectives_match_their_jnp_statements(n, mode, hidden, owners):
    """The all-reduce and the (max, argmax) exchange alone against `jnp_all_reduce` /
    `jnp_argmax`: the residual bit-identical on every device (and to the jnp sum), ties
    to the lowest id across devices (a row where every id ties; a row whose max sits on
    devices 1.. only). Whole 128-lane chunks where they exist (`collectives.chunking`):
    256 columns over 8 devices are 2 chunks, 384 over 4 are 3 (the other devices only
    send and receive); 192 (not whole lanes, as in interpret-mode models) splits 4 ways."""
    proc = subprocess.run(
        [sys.executable, "collectives_check.py", "--tp", n, "--mode", mode, "--hidden", hidden],
        cwd=TESTS, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["owners"] == owners, found
    assert not found["races"] and found["x_same_on_all"] and found["x_err"] == 0.0, found
    assert found["arg_equal"] and found["tie_rows"] == [0, 133], found


def assert_matches(found: dict, dtype: str) -> None:
    assert not found["races"], found
    assert found["paths_equal"] and found["bonus_equal"], found
    assert not found["nan_logits"], found
    tol = 1e-4 if dtype == "f32" else 5e-2  # a bf16 block reduced in another order
    assert found["logit_err"] < tol and found["kv_err"] < tol, found
    assert found["accepted"] > 0, found  # the trees were built to be partly right


@pytest.mark.slow
def test_two_devices_match_the_reference():
    assert_matches(tp_check("--tp", "2", "--batch", "1"), "f32")


def test_features_split_over_two_devices():
    """A block drafter's features from the kernel split over 2 devices (every device
    holds the whole residual after the all-reduce) equal the one-device XLA forward's."""
    found = tp_check("--tp", "2", "--batch", "2", "--taps", "1,0")
    assert_matches(found, "f32")
    assert found["feat_err"] < 1e-4, found


@pytest.mark.slow
def test_a_missing_semaphore_wait_is_caught():
    """Skipping one wait for a peer's DMA (the bug the one-slot argument rules out) is
    seen: eagerly run DMAs give the race detector a read racing a remote write."""
    found = tp_check("--tp", "2", "--batch", "2", "--drop-wait")
    assert found["races"], found


CASES = [
    # n, dtype, K/V heads (replicated when fewer than n), DMA mode, rows, config overrides,
    # (weight_ring, mlp_ring). 9 rows = every (tree, context) pair once.
    ("4", "f32", "2", "eager", "9", {}, "2,2"),
    ("8", "f32", "1", "eager", "9", {}, "3,5"),
    ("8", "bf16", "8", "on_wait", "4", {}, "2,2"),
    ("4", "bf16", "8", "on_wait", "4", {}, "3,6"),
    ("2", "f32", "2", "on_wait", "4", {"attention_bias": True, "tie_word_embeddings": True},
     "2,2"),
    ("4", "f32", "4", "eager", "4", {"qk_norm": True, "vocab_size": 1000}, "4,2"),
    ("2", "bf16", "1", "eager", "1", {}, "2,2"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("n,dtype,kv,mode,batch,config,rings", CASES)
def test_n_devices_match_the_reference(n, dtype, kv, mode, batch, config, rings):
    found = tp_check(
        "--tp", n, "--dtype", dtype, "--kv-heads", kv, "--mode", mode, "--batch", batch,
        "--config", json.dumps(config), "--rings", rings,
    )  # fmt: skip
    assert_matches(found, dtype)


@pytest.mark.slow
def test_a_missing_wait_gives_a_wrong_answer_when_dmas_land_late():
    """With DMAs landing only when waited for, the skipped wait leaves an inbox unfilled:
    the result is wrong (the unfilled inbox holds NaN), never quietly right."""
    found = tp_check("--tp", "4", "--batch", "2", "--mode", "on_wait", "--drop-wait")
    assert found["nan_logits"] or not found["paths_equal"], found


# ------------------------------------------------------------------ in-process rules


def test_check_shardable_names_what_does_not_divide():
    cfg = tiny_config()  # H=4, K=2, F=64, D=32
    shard.check_shardable(cfg, 1)
    shard.check_shardable(cfg, 4)  # K=2 divides 4: K/V heads replicated
    with pytest.raises(ValueError, match=r"splits num_heads \(4\) 3 ways"):
        shard.check_shardable(cfg, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) to divide by 2 or to divide 2"):
        shard.check_shardable(tiny_config(num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match=r"intermediate_size \(66\)"):
        shard.check_shardable(tiny_config(intermediate_size=66), 4)
    with pytest.raises(ValueError, match=r"hidden_size \(32\) into chunks of whole 128"):
        shard.check_shardable(cfg, 2, tpu=True)
    with pytest.raises(ValueError, match=r"hidden_size \(34\) 4 ways, or into chunks of 128"):
        shard.check_shardable(tiny_config(hidden_size=34), 4)
    shard.check_shardable(tiny_config(hidden_size=384, num_heads=8), 8, tpu=True)  # 3 chunks
    moe = tiny_config(architecture=Architecture.QWEN3_MOE, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=32, qk_norm=True)  # fmt: skip
    shard.check_shardable(moe, 2)  # whole experts per device
    with pytest.raises(ValueError, match=r"splits num_experts \(6\) 4 ways"):
        shard.check_shardable(moe, 4)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        shard.check_shardable(cfg, 0)


def test_padded_vocab():
    assert shard.padded_vocab(320, 1) == 320
    assert shard.padded_vocab(320, 2) == 512
    assert shard.padded_vocab(1024, 8) == 1024
    assert shard.padded_vocab(1025, 8) == 2048


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])
def test_prepared_params_are_the_same_model(tied):
    """K/V heads repeated (K=1 -> 4) and the head padded: identical logits and each
    original K/V head stored n / K times, so the forward is exact, not approximate."""
    cfg = tiny_config(num_kv_heads=1, tie_word_embeddings=tied, vocab_size=300)
    params = T.init_params(cfg, jax.random.key(3), jnp.float32)
    cfg4, params4 = shard.prepare_params(cfg, params, 4)
    assert cfg4.num_kv_heads == 4 and cfg4.vocab_size == 300
    assert shard.head_width(cfg4, params4) == 512
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 7)), jnp.int32)
    want = T.forward_train(params, cfg, tokens)
    got = T.forward_train(params4, cfg4, tokens)
    assert got.shape == want.shape == (2, 7, 300)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    wk = np.asarray(params4["layers"]["wk"]).reshape(cfg.num_layers, cfg.hidden_size, 4, 8)
    assert all(np.array_equal(wk[..., e, :], wk[..., 0, :]) for e in range(4))


def test_a_padded_head_is_cut_by_its_own_width():
    """V=302 does not divide by 4, but the padded head (512) does: cut, not replicated."""
    cfg = tiny_config(vocab_size=302)
    params = T.init_params(cfg, jax.random.key(0), jnp.float32)
    assert sharding.param_specs(cfg, params, 4)["lm_head"] == P()
    _, padded = shard.prepare_params(cfg, params, 4)
    assert sharding.param_specs(cfg, padded, 4)["lm_head"] == P(None, "tp")


ENGINE_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from pathlib import Path
    from fixtures import tiny_pair
    from specdec import LLM, SamplingParams

    d = tiny_pair(Path({tmp!r}))
    rng = np.random.default_rng(1)
    prompts = [{{"prompt_token_ids": rng.integers(0, 300, n).tolist()}}
               for n in rng.integers(1, 30, 20)]
    spec = {{"method": "draft_model", "model": str(d), "num_speculative_tokens": 6,
             "max_depth": 3, "topk": 2}}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Sampled and penalised rows take their verdict from the kernel's logits, gathered
    # over the devices' vocabulary shards (`reference.decide`).
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=8,
                               ignore_eos=True)

    def run(params, some=prompts, **kw):
        llm = LLM(d, max_model_len=64, max_num_seqs=8, speculative_config=spec, **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(some, params,
                                                                   use_tqdm=False)]

    _, want = run(greedy, kernel="xla")
    for n in (4, 2):  # K=2: replicated to 4 K/V heads on 4 devices; split 2 ways on 2
        some = prompts if n == 4 else prompts[:4]
        llm, got = run(greedy, some, kernel="megakernel", tensor_parallel_size=n)
        assert llm.kernel == "megakernel"
        runner = llm.engine.target.runner
        assert runner.cfg.num_kv_heads == max(2, n), runner.cfg
        assert runner.cache.k.sharding.spec[2] == "tp", runner.cache.k.sharding
        assert got == want[: len(some)], (n, got, want)
        print("greedy", n, len(some), "prompts OK")
    for params in (sampled, penalised):
        _, expect = run(params, prompts[:4], kernel="xla")
        _, got = run(params, prompts[:4], kernel="megakernel", tensor_parallel_size=2)
        assert got == expect, (params, got, expect)
    # Weights split over devices handed to the kernel without its mesh: refused.
    import jax
    from specdec.checkpoint import load_model
    from specdec.kernels import megakernel, sharding
    from specdec.kernels.transformer import KVCache
    cfg, params = load_model(d)
    mesh = sharding.make_mesh(jax.devices()[:2])
    split = sharding.shard_params(cfg, params, mesh)
    try:
        megakernel.verify(split, KVCache.create(cfg, 1, 64), cfg=cfg)
    except ValueError as e:
        assert "placed on 2 devices but no mesh" in str(e), e
    else:
        raise AssertionError("sharded params ran without a mesh")
    try:
        LLM(d, max_model_len=64, tensor_parallel_size=3, kernel="megakernel")
    except ValueError as e:
        assert "splits num_heads (4) 3 ways" in str(e), e
    else:
        raise AssertionError("a 3-way split of 4 heads was accepted")
    print("OK")
    """
)


@pytest.mark.slow
def test_llm_tensor_parallel_megakernel_equals_one_device_xla(tmp_path):
    """`LLM(tensor_parallel_size=n, kernel="megakernel")`: the same tokens as one
    device's XLA path (greedy on 20 prompts at n = 4; seeded sampling and a repetition
    penalty at n = 2), with a draft model's trees."""
    code = ENGINE_CHILD.format(tests=str(TESTS), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout.splitlines()[-1]
