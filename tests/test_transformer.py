"""The reference transformer's tree forward and KV commit against plain decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.megakernel.reference import tree_block

CONFIGS = {
    "llama_gqa": ModelConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8,
    ),
    "qwen3_kv1": ModelConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=1, head_dim=12, architecture=Architecture.QWEN3, qk_norm=True,
    ),
    "mistral_window": ModelConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
        num_kv_heads=2, head_dim=16, architecture=Architecture.MISTRAL, sliding_window=5,
    ),
    # DeepSeek-V3 class: MLA (absorbed, over the latent cache), YaRN, a dense first
    # layer, then routed + shared experts.
    "deepseek_mla": ModelConfig(
        vocab_size=70, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=1, head_dim=8, architecture=Architecture.DEEPSEEK_V3, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=12, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        scoring_func="sigmoid", expert_bias=True, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
        rope_scaling=RopeScaling(rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=16, mscale=1.0,
                                 mscale_all_dim=0.7),
    ),
    # Hybrid linear attention (Qwen3.5): gated DeltaNet layers around a gated
    # full-attention layer with partial RoPE; 2 key heads serve 4 value heads.
    "qwen3_5_hybrid": ModelConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, architecture=Architecture.QWEN3_5, qk_norm=True,
        attn_output_gate=True, partial_rotary_factor=0.25,
        layer_types=("linear_attention", "full_attention", "linear_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4,
    ),
    # Qwen3-Next: the same mixers with sparse MoE and a gated shared expert.
    "qwen3_next_hybrid": ModelConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, architecture=Architecture.QWEN3_NEXT, qk_norm=True,
        attn_output_gate=True, partial_rotary_factor=0.5,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        n_shared_experts=1, shared_expert_intermediate_size=24, shared_expert_gate=True,
    ),
    # Kimi Linear: KDA (a decay per key channel) around MLA without positions, routed
    # experts after a dense first layer.
    "kimi_kda": ModelConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
        num_kv_heads=1, head_dim=8, architecture=Architecture.KIMI_LINEAR, kv_lora_rank=16,
        qk_nope_head_dim=8, v_head_dim=12, use_rope=False,
        layer_types=("linear_attention", "full_attention", "linear_attention"),
        linear_kind="kda", linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, scoring_func="sigmoid",
        expert_bias=True, n_shared_experts=1, first_k_dense_replace=1,
    ),
}  # fmt: skip


def random_tree(rng: np.random.Generator, n: int) -> np.ndarray:
    """parents i32[n] in topological order, -1 = child of root."""
    return np.array([rng.integers(-1, i) for i in range(n)], np.int32)


MAX_LEN = 32  # one cache size everywhere, so each config compiles each shape once


def decode_path_logits(params, cfg, prompt, path_tokens):
    """Logits after each token of `path_tokens`, fed one at a time after the prompt."""
    cache = T.KVCache.create(cfg, 1, MAX_LEN)
    one = jnp.ones((1, 1, 1), bool)
    slots = jnp.zeros(1, jnp.int32)
    n = len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    mask = T.causal_block_mask(jnp.array([n]), n)
    _, cache = T.forward_block(
        params, cache, tokens, positions, mask, slots, jnp.zeros(1, jnp.int32), cfg=cfg
    )
    out = []
    for i, t in enumerate(path_tokens):
        pos = jnp.array([[n + i]], jnp.int32)
        logits, cache = T.forward_block(
            params, cache, jnp.array([[t]], jnp.int32), pos, one, slots,
            jnp.array([n + i], jnp.int32), cfg=cfg,
        )  # fmt: skip
        out.append(np.asarray(logits[0, 0]))
    return out


QUICK_TREE = ("llama_gqa",)
# (config, seed): two random trees per config, one for MLA (its compile dominates).
TREE_CASES = [
    pytest.param(name, seed, marks=() if name in QUICK_TREE and not seed else pytest.mark.slow)
    for name in CONFIGS
    for seed in ((0,) if name == "deepseek_mla" else (0, 1))
]


@pytest.mark.parametrize(("name", "seed"), TREE_CASES)
def test_tree_forward_matches_path_decode(name, seed):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(seed)
    params = _scaled(T.init_params(cfg, jax.random.key(seed)))
    prompt_len, n = 6, 10
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    committed, root = prompt[:-1], prompt[-1]
    parents = random_tree(rng, n)
    tokens = rng.integers(0, cfg.vocab_size, n).astype(np.int32)

    # Tree forward over [root, nodes] after prefilling the committed tokens.
    cache = T.KVCache.create(cfg, 2, MAX_LEN)
    cache = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), cache)
    slots = jnp.array([1], jnp.int32)  # a non-zero slot, NaN everywhere unused
    c = len(committed)
    _, cache = T.forward_block(
            params, cache, jnp.asarray([committed], jnp.int32),
            jnp.arange(c, dtype=jnp.int32)[None], T.causal_block_mask(jnp.array([c]), c),
            slots, jnp.zeros(1, jnp.int32), cfg=cfg,
        )  # fmt: skip
    block, positions, mask = tree_block(
        jnp.array([root], jnp.int32), jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
        jnp.array([c], jnp.int32),
    )  # fmt: skip
    logits, _ = T.forward_block(
        params, cache, block, positions, mask, slots, jnp.array([c], jnp.int32), cfg=cfg
    )
    logits = np.asarray(logits[0])
    assert np.isfinite(logits).all()

    # Each node's logits equal decoding its root-to-node path one token at a time.
    path_logits = decode_path_logits(params, cfg, committed, [root])
    # Two float32 orders of the same sums (chunked recurrence vs one token at a time):
    # on an AVX-512 Xeon they differed by 1.05e-5 at logits of 1.6 (a wrong state or
    # mask moves them by tenths).
    np.testing.assert_allclose(logits[0], path_logits[0], atol=1e-5, rtol=1e-5)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        ref = decode_path_logits(params, cfg, committed, [root] + path[::-1])[-1]
        np.testing.assert_allclose(logits[i + 1], ref, atol=1e-5, rtol=1e-5)


def full_tree(depth: int, children: int) -> np.ndarray:
    """parents of a complete tree (every node above `depth` has `children` children),
    in breadth-first (topological) order; -1 = child of root."""
    parents, level = [], [-1]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(children):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.array(parents, np.int32)


@pytest.mark.slow  # ~10 s of compiles each; quick: test_hybrid_spec's chunked-form test
@pytest.mark.parametrize("name", ["qwen3_5_hybrid", "qwen3_next_hybrid", "kimi_kda"])
def test_hybrid_tree_verify_and_commit_match_path_decode(name):
    """Linear-attention layers in one tree pass: each node of a depth-4 binary tree sees
    its own path's recurrent and convolution state (logits equal decoding that path);
    committing an accepted path (whole, or cut short) leaves the state plain decoding of
    it leaves: the next token's logits agree."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    params = _scaled(T.init_params(cfg, jax.random.key(5)))
    committed = rng.integers(0, cfg.vocab_size, 5).tolist()
    root = int(rng.integers(0, cfg.vocab_size))
    parents = full_tree(4, 2)  # 30 nodes
    n = len(parents)
    tokens = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    # NaN wherever nothing was written: a fresh sequence must not read a slot's old state.
    # The cache has decode_path_logits' shape, so the two share their compiled steps.
    cache = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), T.KVCache.create(cfg, 1, MAX_LEN))
    slots, c = jnp.array([0], jnp.int32), len(committed)
    _, cache = T.forward_block(
            params, cache, jnp.asarray([committed], jnp.int32),
            jnp.arange(c, dtype=jnp.int32)[None], T.causal_block_mask(jnp.array([c]), c),
            slots, jnp.zeros(1, jnp.int32), cfg=cfg,
        )  # fmt: skip
    block, positions, mask = tree_block(
        jnp.array([root], jnp.int32), jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
        jnp.array([c], jnp.int32),
    )  # fmt: skip
    lens = jnp.array([c], jnp.int32)
    tree_pass = jax.jit(T.block_logits_kv, static_argnames=("cfg",))
    logits, ks, vs = tree_pass(params, cache, block, positions, mask, slots, lens, cfg=cfg)
    logits = np.asarray(logits[0])

    def path_of(i):
        path = []
        while i >= 0:
            path.append(i)
            i = int(parents[i])
        return path[::-1]

    leaves = sorted(set(range(n)) - set(parents.tolist()))
    for leaf in leaves:  # every node lies on a leaf's path: decode each leaf's path once
        path = path_of(leaf)
        want = decode_path_logits(params, cfg, committed, [root, *tokens[path]])
        for depth, node in enumerate(path, start=1):
            np.testing.assert_allclose(logits[node + 1], want[depth], atol=1e-5, rtol=0)

    nxt = int(rng.integers(0, cfg.vocab_size))
    for leaf, keep_n in ((n - 1, 4), (n - 5, 2), (0, 0)):
        path = path_of(leaf)[:keep_n]
        keep = jnp.asarray([[0, *[j + 1 for j in path], *[0] * (4 - len(path))]], jnp.int32)
        counts = jnp.array([1 + len(path)], jnp.int32)
        after = T.write_kv(jax.tree.map(jnp.copy, cache), ks, vs, slots, lens, keep, counts)
        m = c + 1 + len(path)
        got, _ = T.forward_block(
            params, after, jnp.array([[nxt]], jnp.int32), jnp.array([[m]], jnp.int32),
            jnp.ones((1, 1, 1), bool), slots, jnp.array([m], jnp.int32), cfg=cfg,
        )  # fmt: skip
        want = decode_path_logits(params, cfg, committed, [root, *tokens[path], nxt])[-1]
        np.testing.assert_allclose(np.asarray(got[0, 0]), want, atol=1e-5, rtol=0)


def _scaled(params):
    """Weights ~ N(0, 1 / fan_in) (init_params' std 0.02 leaves every logit near zero,
    where a wrong mask or cache entry would hide under the tolerance); norms as they are."""

    def scale(path, w):
        name = path[-1].key
        if w.ndim < 2 or name.endswith("norm"):
            return w
        return w * (1.0 / (0.02 * np.sqrt(w.shape[-2])))

    return jax.tree_util.tree_map_with_path(scale, params)


def test_mla_cache_holds_the_latent_and_rotary_key_only():
    """MLA caches kv_lora_rank + qk_rope_head_dim values per token per layer, in every
    cache form the engine allocates and in the byte count that sizes it."""
    from specdec.kernels.paged import PagedKVCache

    cfg = CONFIGS["deepseek_mla"]
    per_layer = cfg.kv_lora_rank + cfg.head_dim  # head_dim is the rotary width under MLA
    for dtype in (jnp.float32, jnp.bfloat16):
        size = jnp.dtype(dtype).itemsize
        assert T.token_bytes(cfg, dtype) == cfg.num_layers * per_layer * size
        slot = T.KVCache.create(cfg, 3, 32, dtype)
        paged = PagedKVCache.create(cfg, 3, 32, block_size=16, num_blocks=5, dtype=dtype)
        for cache, tokens in ((slot, 3 * 32), (paged, 5 * 16)):
            held = cache.k.nbytes + cache.v.nbytes
            assert held == tokens * cfg.num_layers * per_layer * size


def test_commit_kv_keeps_accepted_path():
    """After commit, decoding continues exactly as if the path had been decoded."""
    cfg = CONFIGS["llama_gqa"]
    params = T.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(3)
    committed = rng.integers(0, cfg.vocab_size, 5).tolist()
    root = 7
    parents = np.array([-1, -1, 0, 1, 2, 2], np.int32)
    tokens = np.array([11, 12, 13, 14, 15, 16], np.int32)
    accepted = [0, 2, 5]  # path root -> 11 -> 13 -> 16
    c = len(committed)
    cache = T.KVCache.create(cfg, 1, MAX_LEN)
    slots = jnp.zeros(1, jnp.int32)
    _, cache = T.forward_block(
        params, cache, jnp.asarray([committed], jnp.int32),
        jnp.arange(c, dtype=jnp.int32)[None], T.causal_block_mask(jnp.array([c]), c),
        slots, jnp.zeros(1, jnp.int32), cfg=cfg,
    )  # fmt: skip
    block, positions, mask = tree_block(
        jnp.array([root], jnp.int32), jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
        jnp.array([c], jnp.int32),
    )  # fmt: skip
    _, cache = T.forward_block(
        params, cache, block, positions, mask, slots, jnp.array([c], jnp.int32), cfg=cfg
    )
    src = jnp.array([[a + 1 for a in accepted] + [0, 0, 0]], jnp.int32)
    cache = T.commit_kv(cache, slots, jnp.array([c], jnp.int32), src, jnp.array([3]))
    # Next token after the path, from the committed cache (c + 1 + 3 entries).
    nxt = 21
    logits, _ = T.forward_block(
        params, cache, jnp.array([[nxt]], jnp.int32), jnp.array([[c + 4]], jnp.int32),
        jnp.ones((1, 1, 1), bool), slots, jnp.array([c + 4], jnp.int32), cfg=cfg,
    )  # fmt: skip
    ref = decode_path_logits(params, cfg, committed, [root, 11, 13, 16, nxt])[-1]
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_forward_train_matches_prefill():
    cfg = CONFIGS["qwen3_kv1"]
    params = T.init_params(cfg, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    a = T.forward_train(params, cfg, toks)
    b = T.prefill_logits(params, cfg, toks, jnp.array([9, 9]))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "heads,kv_heads,n,b",
    [
        pytest.param(4, 2, 3, 2, marks=pytest.mark.slow),  # the runner layout test runs it too
        pytest.param(4, 1, 1, 1, marks=pytest.mark.slow),
        pytest.param(6, 3, 5, 3, marks=pytest.mark.slow),
    ],
)
def test_per_kv_head_attention_matches_the_batched_form(heads, kv_heads, n, b):
    """The XLA CPU form (one product per KV head, keys optionally copied out
    transposed) computes what the reference's batched einsums do."""
    from specdec.kernels.xla_layout import XlaLayout

    cfg = ModelConfig(vocab_size=11, hidden_size=16, intermediate_size=8, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=8)  # fmt: skip
    rng = np.random.default_rng(heads + n)
    t, hd = 13, 8
    q = jnp.asarray(rng.normal(size=(b, n, kv_heads, heads // kv_heads, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, n, kv_heads, hd)), jnp.float32) for _ in "kv")
    kc, vc = (jnp.asarray(rng.normal(size=(b, kv_heads, t, hd)), jnp.float32) for _ in "kv")
    cache_mask = jnp.asarray(rng.random((b, n, t)) < 0.6)
    cache_mask = cache_mask.at[0, 0].set(False)  # a query that sees no cached key
    block_mask = jnp.asarray(rng.random((b, n, n)) < 0.5) | jnp.eye(n, dtype=bool)[None]
    args = (cfg, q, k, v, kc, vc, cache_mask, block_mask)
    per_head = XlaLayout(per_kv_head=True).attention(*args)
    keys_t = XlaLayout(per_kv_head=True, keys_transposed=True).attention(*args)
    np.testing.assert_allclose(np.asarray(keys_t), np.asarray(per_head), atol=1e-5, rtol=1e-5)
    batched = T.REFERENCE.attention(*args)
    assert per_head.shape == batched.shape == (b, n, heads * hd)
    np.testing.assert_allclose(np.asarray(per_head), np.asarray(batched), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 4)])
def test_one_row_bfloat16_product_matches_plain_matmul(lead):
    """The one-row bfloat16 detour (two rows, first kept) changes no number."""
    from specdec.kernels.xla_layout import XlaLayout

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(40, 24)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(*lead, 40)), jnp.float32)
    got = jax.jit(XlaLayout(two_row_bf16=True).matmul)(x, w)
    want = jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    assert got.shape == (*lead, 24) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["llama_gqa", pytest.param("qwen3_kv1", marks=pytest.mark.slow),
             pytest.param("deepseek_mla", marks=pytest.mark.slow)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_runner_layout_forward_matches_the_reference(name, rows):
    """Everything `xla_layout.arrange` does at once (per-layer, untied head, fused
    projections, one-row copies, per-head attention, two-row bf16): the reference's
    logits, for one-row and many-row blocks."""
    from specdec.kernels import xla_layout

    cfg = CONFIGS[name]
    params = T.init_params(cfg, jax.random.key(4))
    arranged, layout = xla_layout.arrange(cfg, params, fuse=True, one_row=True, backend="cpu")
    assert "one_row" in arranged and layout.per_kv_head and layout.two_row_bf16
    tokens = jnp.asarray(np.random.default_rng(rows).integers(0, cfg.vocab_size, (2, rows)))
    lengths = jnp.asarray([rows, max(1, rows - 2)], jnp.int32)
    want = T.prefill_logits(params, cfg, tokens, lengths)
    for lay in (layout, layout.for_library("eigen")):
        got = T.prefill_logits(arranged, cfg, tokens, lengths, lay)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_cpu_caches_of_bfloat16_weights():
    """XLA CPU cannot write a bfloat16 buffer in place (it widens all of it to float32
    and back), so a paged cache of bfloat16 weights keeps the bfloat16 bits in uint16,
    written in place and read back as bfloat16; the megakernel's slot cache is float32."""
    from specdec.kernels.runner import ModelRunner
    from specdec.kernels.xla_layout import cache_dtype

    assert jax.default_backend() == "cpu"
    assert cache_dtype(jnp.bfloat16) == jnp.uint16
    assert cache_dtype(jnp.bfloat16, paged=False) == jnp.float32 == cache_dtype(jnp.float32)
    assert cache_dtype(jnp.bfloat16, backend="tpu") == jnp.bfloat16
    cfg = CONFIGS["llama_gqa"]
    params = T.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    stacked = ModelRunner(cfg, params, num_slots=1, max_len=MAX_LEN, stacked=True)
    assert stacked.cache.k.dtype == jnp.float32
    runner = ModelRunner(cfg, params, num_slots=2, max_len=MAX_LEN)
    assert runner.cache.k.dtype == jnp.uint16
    assert runner.params["embed"].dtype == jnp.bfloat16
    assert runner.token_bytes == 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, 1, 3, cfg.num_kv_heads, cfg.head_dim)  # [L, B, N, K, hd]
    ks, vs = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in "kv")
    runner.ensure([1], [3])
    cache = runner.cache
    before = cache.k.unsafe_buffer_pointer()
    runner.cache = T.write_kv(cache, ks, vs, jnp.asarray([1]), jnp.asarray([0], jnp.int32))
    assert runner.cache.k.unsafe_buffer_pointer() == before  # in place
    for got, want in zip(runner.slot_kv(1, 3), (ks, vs), strict=True):  # [L, K, 3, hd]
        rounded = np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(got, rounded[:, 0].transpose(0, 2, 1, 3))


def test_prefill_chunk_lengths():
    from specdec.kernels.runner import chunk_len

    assert [chunk_len(n, 512) for n in (1, 3, 5, 16, 17, 100, 128)] == [
        16,
        16,
        16,
        16,
        32,
        128,
        128,
    ]
    assert [chunk_len(n, 512) for n in (129, 160, 161, 256, 257, 300, 449, 481, 512)] == [
        160, 160, 192, 256, 320, 320, 512, 512, 512,
    ]  # fmt: skip
    assert chunk_len(900, 512) == 512 and chunk_len(100, 64) == 64 and chunk_len(3, 8) == 8
    for n in range(129, 2049):  # at most 25% padding, whole 16-row tiles
        c = chunk_len(n, 4096)
        assert n <= c <= n * 1.25 and c % 16 == 0, n
    assert len({chunk_len(n, 512) for n in range(1, 513)}) == 12


@pytest.mark.slow
def test_prefill_with_a_non_power_of_two_chunk_matches_the_plain_forward():
    """Prompts of 300 and 130 tokens prefill as one 320-token chunk (`chunk_len`)."""
    import dataclasses

    from specdec.kernels.runner import ModelRunner

    cfg = dataclasses.replace(CONFIGS["qwen3_kv1"], max_position_embeddings=1024)
    params = T.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (300, 130)]
    r = ModelRunner(cfg, params, num_slots=2, max_len=1024)
    got = np.asarray(r.prefill([0, 1], prompts))
    for i, p in enumerate(prompts):
        want = T.forward_train(params, cfg, jnp.array([p]))[0, -1]
        np.testing.assert_allclose(got[i], np.asarray(want), atol=2e-5, rtol=0)
    assert list(r.cache_lens) == [300, 130]


@pytest.mark.parametrize(
    "name", ["llama_gqa", pytest.param("mistral_window", marks=pytest.mark.slow)]
)
def test_multi_chunk_prefill_reads_only_earlier_chunks_and_matches_the_plain_forward(name):
    """Chunk 0 reads no cache; chunk i reads positions [0, start): logits and the
    K/V a later decode step attends to equal the one-pass forward."""
    import dataclasses

    from specdec.kernels.runner import ModelRunner

    cfg = dataclasses.replace(CONFIGS[name], max_position_embeddings=256)
    params = T.init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (100, 45)]
    r = ModelRunner(cfg, params, num_slots=2, max_len=160, prefill_chunk=32)
    got = np.asarray(r.prefill([0, 1], prompts))
    nxt = [7, 11]
    logits, _ = T.forward_block(
        r.params, r.cache, jnp.array([[t] for t in nxt], jnp.int32),
        jnp.array([[len(p)] for p in prompts], jnp.int32), jnp.ones((2, 1, 1), bool),
        jnp.arange(2, dtype=jnp.int32), jnp.asarray(r.cache_lens), cfg=cfg,
    )  # fmt: skip
    for i, p in enumerate(prompts):
        want = T.forward_train(params, cfg, jnp.array([p + [nxt[i]]]))[0]
        np.testing.assert_allclose(got[i], np.asarray(want[-2]), atol=2e-5, rtol=0)
        decoded = np.asarray(logits[i, 0])
        np.testing.assert_allclose(decoded, np.asarray(want[-1]), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        CONFIGS["qwen3_kv1"],
        pytest.param(
            ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=8, architecture=Architecture.QWEN2,
                        attention_bias=True), marks=pytest.mark.slow),
        pytest.param(
            ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=8,
                        architecture=Architecture.QWEN3_MOE, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=8), marks=pytest.mark.slow),
    ],
    ids=["qwen3_kv1", "qwen2_bias", "qwen3_moe"],
)  # fmt: skip
def test_fused_projections_give_the_same_logits(cfg):
    from specdec.kernels.xla_layout import XlaLayout, fuse_projections

    params = T.unstack_layers(T.init_params(cfg, jax.random.key(3)))
    fused = fuse_projections(params)
    lp = fused["layers"][0]
    assert "wqkv" in lp and not {"wq", "wk", "wv"} & set(lp)
    assert ("w_gate_up" in lp) == (not cfg.is_moe) and "w_gate" not in lp
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 6], jnp.int32)
    np.testing.assert_allclose(
        T.prefill_logits(fused, cfg, tokens, lengths, XlaLayout()),
        T.prefill_logits(params, cfg, tokens, lengths), rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="per-layer params"):
        fuse_projections(T.init_params(cfg, jax.random.key(3)))


@pytest.mark.parametrize(
    "t,n_e,k,skew",
    [(1, 8, 2, False), (100, 6, 2, True)]
    + [pytest.param(*c, marks=pytest.mark.slow) for c in ((17, 32, 2, False), (100, 8, 3, False),
                                                          (5, 4, 4, False))],
)  # fmt: skip
def test_routed_experts_equal_the_dense_form(t, n_e, k, skew):
    """Only the routed experts, tile by tile, give what every expert on every token
    weighted does: decode / verify / prefill sizes, every expert taken (k = E), and
    one expert taking every token (its pairs span two tiles)."""
    rng = np.random.default_rng(t + n_e)
    d, f = 16, 24
    lp = {name: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
          for name, shape in (("e_gate", (n_e, d, f)), ("e_up", (n_e, d, f)),
                              ("e_down", (n_e, f, d)))}  # fmt: skip
    h = jnp.asarray(rng.normal(size=(1, t, d)), jnp.float32)
    logits = rng.normal(size=(1, t, n_e))
    if skew:
        logits[..., 0] += 100.0
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(jnp.asarray(logits, jnp.float32)), k)
    want = T.dense_experts(lp, h, top_w, top_i)
    got = jax.jit(T.routed_experts)(lp, h, top_w, top_i)
    assert got.shape == want.shape == (1, t, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mla", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bfloat16_experts_widened_on_cpu_give_the_reference_logits(mla):
    """On CPU a bfloat16 MoE's experts (and MLA's per-head up-projections) are held as
    float32 (else XLA widens every expert each step; it has no bfloat16 batched dot)
    with their products' inputs rounded to bfloat16: the forward then gives the
    logits of the bfloat16 weights as they are."""
    from specdec.kernels import xla_layout

    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=8, architecture=Architecture.QWEN3_MOE,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                      norm_topk_prob=True)  # fmt: skip
    cfg = CONFIGS["deepseek_mla"] if mla else cfg
    params = T.init_params(cfg, jax.random.key(5), jnp.bfloat16)
    arranged, layout = xla_layout.arrange(cfg, params, backend="cpu")
    assert layout.narrow_dtype == "bfloat16" and not layout.dense_experts
    wide = [lp[k] for lp in arranged["layers"] for k in xla_layout.WIDE_KEYS if k in lp]
    assert len(wide) >= 3 * (cfg.num_layers - cfg.first_k_dense_replace) + 2 * mla * 2
    assert all(w.dtype == jnp.float32 for w in wide)
    assert arranged["layers"][0]["wo"].dtype == jnp.bfloat16
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    lengths = jnp.asarray([11, 7], jnp.int32)
    want = T.prefill_logits(params, cfg, tokens, lengths)
    got = T.prefill_logits(arranged, cfg, tokens, lengths, layout)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "n_group,topk_group,norm", [(4, 2, True), pytest.param(1, 1, False, marks=pytest.mark.slow)]
)
def test_deepseek_v3_routing_matches_transformers(n_group, topk_group, norm):
    """Sigmoid scores, the correction bias steering the choice only, group-limited
    top-k and the scaling factor: the same experts and weights as transformers'
    DeepseekV3TopkRouter, token by token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    d, n_e, k = 32, 16, 4
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=d, n_routed_experts=n_e, num_experts_per_tok=k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = hf.DeepseekV3TopkRouter(hf_cfg)
    rng = np.random.default_rng(n_group)
    weight = rng.normal(size=(n_e, d)).astype(np.float32)
    bias = rng.normal(size=n_e).astype(np.float32) * 0.5
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    h = rng.normal(size=(9, d)).astype(np.float32)
    with torch.no_grad():
        _, want_w, want_i = router(torch.from_numpy(h))
    cfg = ModelConfig(vocab_size=8, hidden_size=d, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8, num_experts=n_e,
                      num_experts_per_tok=k, moe_intermediate_size=8, norm_topk_prob=norm,
                      scoring_func="sigmoid", expert_bias=True, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=2.5)  # fmt: skip
    lp = {"router": jnp.asarray(weight.T), "e_bias": jnp.asarray(bias),
          "e_gate": jnp.zeros((n_e, d, 8))}  # fmt: skip
    got_w, got_i = T.route(cfg, lp, jnp.asarray(h))
    want_i, want_w = want_i.numpy(), want_w.numpy()
    for t in range(h.shape[0]):  # transformers picks unsorted: compare as sets
        assert set(np.asarray(got_i[t]).tolist()) == set(want_i[t].tolist()), t
        order_g, order_w = np.argsort(np.asarray(got_i[t])), np.argsort(want_i[t])
        np.testing.assert_allclose(np.asarray(got_w[t])[order_g], want_w[t][order_w], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


def test_routing_config_is_checked():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=2, head_dim=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=4)  # fmt: skip
    for bad, why in (
        ({"n_group": 3}, "divide num_experts"),
        ({"topk_group": 2}, "topk_group"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "group-limited"),
    ):
        with pytest.raises(ValueError, match=why):
            ModelConfig(**(base | bad))
