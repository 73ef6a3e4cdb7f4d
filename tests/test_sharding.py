"""Tensor-parallel placement: which axis each weight is cut on, and unchanged outputs.

The numeric checks need 4 devices, fixed when JAX starts, so they run in a
child process with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from fixtures import tiny_config
from jax.sharding import PartitionSpec as P

from specdec.kernels import sharding
from specdec.kernels.transformer import init_params, unstack_layers


def test_specs_cut_whole_heads_and_replicate_what_does_not_divide():
    # H=4, K=2, F=64, V=320 on tp=4: K does not divide -> wk / wv / cache replicated.
    cfg = tiny_config()
    specs = sharding.param_specs(cfg, init_params(cfg, jax.random.key(0)), 4)
    lay = specs["layers"]
    assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp")
    assert lay["wq"] == P(None, None, "tp") and lay["wo"] == P(None, "tp", None)
    assert lay["wk"] == P() and lay["wv"] == P()
    assert lay["w_gate"] == P(None, None, "tp") and lay["w_down"] == P(None, "tp", None)
    assert lay["attn_norm"] == P() and specs["final_norm"] == P()
    assert sharding.cache_spec(cfg, 4) == P()
    assert sharding.cache_spec(cfg, 2) == P(None, None, "tp", None, None)
    assert sharding.cache_spec(cfg, 2, paged=True) == P(None, "tp", None, None, None)
    two = sharding.param_specs(cfg, init_params(cfg, jax.random.key(0)), 2)
    assert two["layers"]["wk"] == P(None, None, "tp")  # K=2 splits 2 ways


def test_specs_fit_unstacked_layers_and_one_device():
    cfg = tiny_config(vocab_size=322)  # 322 % 4 != 0: vocabulary replicated
    params = unstack_layers(init_params(cfg, jax.random.key(0)))
    specs = sharding.param_specs(cfg, params, 4)
    assert specs["layers"][1]["wq"] == P(None, "tp")  # [D, H*hd] without the L axis
    assert specs["layers"][0]["w_down"] == P("tp", None)
    assert specs["embed"] == P() and specs["lm_head"] == P()
    one = sharding.param_specs(cfg, params, 1)
    assert all(s == P() for s in jax.tree.leaves(one, is_leaf=lambda x: isinstance(x, P)))
    assert sharding.describe(cfg, 4)["embed"] == "replicated"


def test_one_row_copies_are_cut_like_their_originals_transposed():
    from specdec.kernels.xla_layout import one_row_copies, untie_head

    cfg = tiny_config()  # H=4, F=64, V=320 divide by 4; K=2 does not
    params = one_row_copies(untie_head(unstack_layers(init_params(cfg, jax.random.key(0)))),
                            tied=False)  # fmt: skip
    specs = sharding.param_specs(cfg, params, 4)
    lay, t = specs["layers"][0], specs["layers"][0]["one_row"]
    assert lay["wq"] == P(None, "tp") and t["wq"] == P("tp", None)
    assert lay["wo"] == P("tp", None) and t["wo"] == P(None, "tp")
    assert t["w_down"] == P(None, "tp") and t["wk"] == P()  # K=2 stays whole
    assert specs["lm_head"] == P(None, "tp") and specs["one_row"]["lm_head"] == P("tp", None)


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from pathlib import Path
    from fixtures import tiny_config, write_model, write_tokenizer
    from specdec import LLM, SamplingParams
    from specdec.kernels import sharding

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [{{"prompt_token_ids": rng.integers(0, 300, n).tolist()}}
               for n in rng.integers(1, 30, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # cache cut by K/V heads; one K/V head (replicated); one slot
    for kv, seqs in ((4, 4), (1, 4), (4, 1)):
        d = Path({tmp!r}) / f"kv{{kv}}_{{seqs}}"
        v = write_tokenizer(d)
        write_model(d, tiny_config(v, num_kv_heads=kv), scale=30.0)
        llm = LLM(d, max_model_len=64, max_num_seqs=seqs)
        some = prompts[: 4 * seqs]  # one slot runs them one by one: fewer
        ref = [o.outputs[0].token_ids for o in llm.generate(some, greedy, use_tqdm=False)]
        runner = llm.engine.target.runner
        assert "one_row" in runner.params  # float32: decode copies whatever the slot count
        sharding.shard_runner(runner, sharding.make_mesh())
        out = [o.outputs[0].token_ids for o in llm.generate(some, greedy, use_tqdm=False)]
        assert out == ref, (kv, seqs)
        spec = runner.cache.k.sharding.spec
        print(kv, "cache", spec, "wq", jax.tree.leaves(runner.params)[0].sharding.spec)
        assert (spec == sharding.cache_spec(llm.config, 4, paged=True)), spec
        # The same through the API: LLM(tensor_parallel_size=4) shards it at start.
        tp = LLM(d, max_model_len=64, max_num_seqs=seqs, tensor_parallel_size=4)
        assert tp.engine.target.runner.cache.k.sharding.spec == spec
        out = [o.outputs[0].token_ids for o in tp.generate(some, greedy, use_tqdm=False)]
        assert out == ref, ("tensor_parallel_size", kv, seqs)
    for bad, why in (({{"tensor_parallel_size": 8}}, "needs that many local devices; JAX sees 4"),
                     ({{"tensor_parallel_size": 3, "kernel": "megakernel"}},
                      "splits num_heads (4) 3 ways")):
        try:
            LLM(d, max_model_len=64, **bad)
        except ValueError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"{{bad}} was accepted")
    print("OK")
    """
)


@pytest.mark.slow
def test_sharded_target_matches_one_device(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")  # fmt: skip
    code = CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout
