"""The DFlash block drafter in the engine (`method="dflash"`, specdec.draft.block):
the target's features at the drafter's layers (equal to transformers' hidden
states), trees equal to a fresh uncached forward over the whole committed
sequence at every step, greedy output equal to plain decoding, and the first two
sampled tokens following the target's own distribution."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import tiny_config, write_model
from hf_models import hf_zoo, load_torch_model, write_dflash  # noqa: F401 (fixture)
from safetensors.numpy import load_file, save_file
from test_spec_engine import assert_first_two_tokens_follow_the_target

from specdec import LLM, SamplingParams
from specdec.checkpoint import load_model
from specdec.draft import dflash
from specdec.draft.block import BlockDrafter, grid_tree, max_tree_nodes, selector_tree
from specdec.kernels import transformer
from specdec.verify.tree import PAD_PARENT

VOCAB = 24  # small enough that a random drafter's candidates are sometimes right
MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHAPES = {
    "chain": dict(num_speculative_tokens=5, max_depth=5, topk=1),
    "tree": dict(num_speculative_tokens=16, max_depth=4, topk=3),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A peaky two-layer target over 24 tokens and a random DFlash drafter reading
    both of its layers (the last one after the final norm, as transformers gives it)."""
    root = tmp_path_factory.mktemp("block")
    target = write_model(root / "t", tiny_config(VOCAB, num_layers=2), seed=3, scale=60.0)
    write_dflash(root / "d", vocab=VOCAB, layers=1, target_layer_ids=(0, 1),
                 num_target_layers=2, block_size=6, mask_token_id=5)  # fmt: skip
    return target, root / "d"


@pytest.fixture(scope="module")
def pair2(pair):
    """The same target with a random DFlash2 drafter (convolutions, selector)."""
    folder = pair[1].parent / "d2"
    v2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 6}
    write_dflash(folder, vocab=VOCAB, layers=1, target_layer_ids=(0, 1), num_target_layers=2,
                 block_size=6, mask_token_id=5, v2=v2, seed=4)  # fmt: skip
    return pair[0], folder


# A draft vocabulary: the drafter proposes only these tokens (EAGLE-3's d2t offsets).
DRAFT_VOCAB = (0, 2, 3, 5, 8, 9, 11, 14, 17, 18, 20, 23)


def add_draft_vocab(folder: Path, ids) -> None:
    """Gives a drafter folder a draft vocabulary (`draft_vocab_size`, `d2t`)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["draft_vocab_size"] = len(ids)
    (folder / "config.json").write_text(json.dumps(cfg))
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights) | {"d2t": dflash.draft_vocab_offsets(ids)}
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair_vocab(pair):
    """The same target with a random DFlash drafter proposing DRAFT_VOCAB's tokens only."""
    folder = pair[1].parent / "dv"
    write_dflash(folder, vocab=VOCAB, layers=1, target_layer_ids=(0, 1), num_target_layers=2,
                 block_size=6, mask_token_id=5, seed=5)  # fmt: skip
    add_draft_vocab(folder, DRAFT_VOCAB)
    return pair[0], folder


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(0, VOCAB, n).tolist()}
            for n in rng.integers(1, 40, 100)]  # fmt: skip


def dflash_llm(pair, max_num_seqs=8, max_model_len=MAX_LEN, kernel="auto", **shape):
    target, drafter = pair
    spec = {"method": "dflash", "model": str(drafter), **shape}
    return LLM(str(target), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               speculative_config=spec, kernel=kernel)  # fmt: skip


# ----------------------------------------------------------------------------- tree growth


def brute_force(logp: np.ndarray, cand: np.ndarray, num_nodes: int, max_depth: int):
    """The num_nodes best paths (by summed log-probability) of every path of at most
    max_depth candidates, as sets of token tuples."""
    k = logp.shape[1]
    paths = [((), 0.0)]
    out = []
    for d in range(max_depth):
        paths = [(p + (r,), s + logp[d, r]) for p, s in paths for r in range(k)]
        out += paths
    out.sort(key=lambda x: -x[1])
    return {tuple(int(cand[i, r]) for i, r in enumerate(p)) for p, _ in out[:num_nodes]}


def tree_paths(tokens: np.ndarray, parents: np.ndarray) -> set:
    paths = {}
    for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        if p == PAD_PARENT:
            continue
        assert p < i  # topological
        paths[i] = (paths[p] if p >= 0 else ()) + (int(t),)
    return set(paths.values())


def test_best_first_example_from_the_docstring():
    logp = jnp.log(jnp.exp(jnp.array([[-0.1, -2.5], [-0.2, -1.9]])))
    cand = jnp.array([[10, 11], [20, 21]])
    tokens, parents = grid_tree(logp, cand, num_nodes=3, max_depth=2)
    assert tokens.tolist() == [10, 20, 21] and parents.tolist() == [-1, 0, 0]


@pytest.mark.parametrize("num_nodes,max_depth,k", [(8, 3, 2), (12, 4, 3), (5, 5, 1), (40, 3, 3)])
def test_best_first_keeps_the_best_paths(num_nodes, max_depth, k):
    rng = np.random.default_rng(num_nodes)
    grow = jax.jit(grid_tree, static_argnames=("num_nodes", "max_depth"))
    n = min(num_nodes, max_tree_nodes(k, max_depth))
    for _ in range(20):
        logp = -np.sort(rng.exponential(1.0, (max_depth, k)), axis=1).astype(np.float32)
        cand = rng.permutation(1000)[: max_depth * k].reshape(max_depth, k)
        tokens, parents = grow(logp, cand, num_nodes=n, max_depth=max_depth)
        tokens, parents = np.asarray(tokens), np.asarray(parents)
        assert (parents >= -1).sum() == n
        assert tree_paths(tokens, parents) == brute_force(logp, cand, n, max_depth)
        kids = np.bincount(parents[parents >= -1] + 1, minlength=n + 1)
        assert kids.max() <= k


# ----------------------------------------------------------------------------- features


def test_features_equal_transformers_hidden_states(hf_zoo):  # noqa: F811
    """Taps 0 and the last layer of a Qwen3 target: transformers' hidden_states[i + 1]
    (the last one after the final norm), through the reference forward and through a
    chunked prefill (prompt 11 tokens in chunks of 4)."""
    import torch

    from specdec.kernels.runner import ModelRunner

    folder = hf_zoo["qwen3"]
    cfg, params = load_model(folder)
    last = cfg.num_layers - 1
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 11).tolist()
    with torch.no_grad():
        hs = load_torch_model(folder)(torch.tensor([prompt]), output_hidden_states=True)
    want = np.concatenate([hs.hidden_states[1][0].numpy(), hs.hidden_states[last + 1][0].numpy()],
                          axis=-1)  # fmt: skip
    n = len(prompt)
    *_, feats = transformer.block_logits_kv(
        params, None, jnp.asarray([prompt]), jnp.arange(n)[None],
        transformer.causal_block_mask(jnp.array([n]), n), jnp.zeros(1, jnp.int32),
        jnp.zeros(1, jnp.int32), cfg=cfg, taps=(0, last),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(feats[0]), want, atol=1e-4, rtol=0)
    runner = ModelRunner(cfg, params, num_slots=2, max_len=64, prefill_chunk=4)
    runner.taps = (0, last)
    runner.prefill([1], [prompt])
    got = np.zeros_like(want)
    for c in runner.prefill_features:
        assert c.slot == 1
        got[c.start : c.start + c.count] = np.asarray(c.rows)[0, : c.count]
    assert sum(c.count for c in runner.prefill_features) == n
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- the engine


PAD = 128  # references run at one padded length: one compile each


@functools.partial(jax.jit, static_argnames=("cfg", "taps"))
def _features(params, seq, *, cfg, taps):
    t = seq.shape[1]
    *_, feats = transformer.block_logits_kv(
        params, None, seq, jnp.arange(t)[None], transformer.causal_block_mask(jnp.array([t]), t),
        jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), cfg=cfg, taps=taps,
    )  # fmt: skip
    return feats[0]


def features(tcfg, tparams, seq, taps) -> np.ndarray:
    """The target's features f32[len(seq), F] at `taps` over `seq` (one causal forward;
    padding after the sequence changes nothing before it)."""
    padded = np.zeros((1, PAD), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_features(tparams, padded, cfg=tcfg, taps=tuple(taps)))[: len(seq)]


@functools.partial(jax.jit, static_argnames=("dcfg", "tcfg", "depth", "topk", "nodes"))
def _fresh_tree(dparams, tparams, seq, n, *, dcfg, tcfg, depth, topk, nodes):
    feats = _features(tparams, seq, cfg=tcfg, taps=dcfg.target_layer_ids)
    ctx = dflash.context_rows(dcfg, dparams, feats[None])
    q = dcfg.block_size
    block_tokens = jnp.full((1, q), dcfg.mask_token_id, jnp.int32).at[0, 0].set(seq[0, n - 1])
    block = tparams["embed"][block_tokens] * dcfg.input_embedding_scale
    positions = jnp.concatenate([jnp.arange(PAD), n - 1 + jnp.arange(q)])[None]
    valid = jnp.arange(PAD)[None] < n - 1  # every committed token but the root
    hidden = dflash.forward(dcfg, dparams, ctx, block, positions, valid)
    head = transformer.head_logits(tcfg, tparams, hidden[:, 1 : 1 + depth])
    ids = dparams.get("vocab_ids")  # a draft vocabulary: its tokens' logits only
    logits = dflash.draft_logits(dcfg, head if ids is None else head[..., ids])
    if dcfg.is_dflash2:
        unary, cand, proj = dflash.selector_inputs(dcfg, dparams, hidden[:, 1 : 1 + depth], logits)
        cand = cand if ids is None else ids[cand]
        return selector_tree(dparams, unary[0], cand[0], proj[0], seq[0, n - 1], num_nodes=nodes,
                             max_depth=depth, topk=topk)  # fmt: skip
    logp, cand = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), topk)
    cand = cand if ids is None else ids[cand]
    return grid_tree(logp[0], cand[0], num_nodes=nodes, max_depth=depth)


def fresh_tree(dcfg, dparams, tcfg, tparams, seq, drafter: BlockDrafter):
    """The tree for committed tokens `seq` (root last) from scratch: the target's
    features over the whole sequence, the drafter's uncached forward, best-first."""
    padded = np.zeros((1, PAD), np.int32)
    padded[0, : len(seq)] = seq
    tokens, parents = _fresh_tree(
        dparams, tparams, padded, len(seq), dcfg=dcfg, tcfg=tcfg, depth=drafter.max_depth,
        topk=drafter.topk, nodes=drafter.max_nodes,
    )  # fmt: skip
    return np.asarray(tokens), np.asarray(parents)


class FakeTarget:
    """What a block drafter reads of its target worker: config, runner (prefill
    features) and the last verify's features, which the test sets itself."""

    def __init__(self, cfg, params, taps):
        from specdec.kernels.runner import ModelRunner

        self.cfg = cfg
        self.runner = ModelRunner(cfg, params, num_slots=2, max_len=160, prefill_chunk=8)
        self.runner.taps = taps
        self.features = None

    def tap(self, layers) -> None:
        assert tuple(layers) == self.runner.taps


@pytest.mark.parametrize("version", [1, 2, "vocab"])
def test_long_accepted_paths_are_caught_up(pair, pair2, pair_vocab, version):
    """Verdicts accepting 0 .. max_depth nodes along random paths (the verify's features
    at every other node random): each next tree equals a fresh forward's, so the
    drafter keeps exactly the root's and the accepted nodes' features, at their
    positions. The prompt's features arrive in prefill chunks of 8. DFlash2: trees from
    its selector, each node's children after its own token. "vocab": a draft
    vocabulary, whose tokens alone the trees hold."""
    pair = {1: pair, 2: pair2, "vocab": pair_vocab}[version]
    tcfg, tparams = load_model(pair[0])
    dcfg, dparams = dflash.load(pair[1])
    fake = FakeTarget(tcfg, tparams, dcfg.target_layer_ids)
    drafter = BlockDrafter(dcfg, dparams, num_slots=2, max_model_len=120, num_nodes=12,
                           max_depth=4, topk=3, vocab_limit=VOCAB)  # fmt: skip
    drafter.bind(fake)
    rng = np.random.default_rng(1)
    slot, n = 1, drafter.max_nodes
    committed = rng.integers(0, VOCAB, 19).tolist()
    fake.runner.prefill([slot], [committed])
    committed.append(int(rng.integers(VOCAB)))  # the root
    drafter.start([slot], [committed[:-1]], [committed[-1]])
    active = np.array([False, True])
    accepted_total = 0
    for _ in range(10):
        roots = np.array([0, committed[-1]], np.int32)
        tree = drafter.propose(active, roots, None)
        tokens, parents = np.asarray(tree.tokens)[slot], np.asarray(tree.parents)[slot]
        want_t, want_p = fresh_tree(dcfg, dparams, tcfg, tparams, committed, drafter)
        np.testing.assert_array_equal(parents, want_p)
        np.testing.assert_array_equal(tokens, want_t)
        if version == "vocab":
            assert set(tokens[parents != PAD_PARENT].tolist()) <= set(DRAFT_VOCAB)
        path, node = [], -1  # a random root-to-node path of the tree
        while (kids := np.flatnonzero(parents == node)).size and rng.random() < 0.85:
            node = int(rng.choice(kids))
            path.append(node)
        accepted_total += len(path)
        before = len(committed)
        committed += [int(tokens[i]) for i in path] + [int(rng.integers(VOCAB))]  # + bonus
        full = features(tcfg, tparams, committed, dcfg.target_layer_ids)
        block = rng.standard_normal((1, n + 1, full.shape[1])).astype(np.float32)
        block[0, 0] = full[before - 1]  # the root
        for j, i in enumerate(path):
            block[0, i + 1] = full[before + j]
        fake.features = (np.array([slot], np.int32), jnp.asarray(block))
        accepted = np.full((2, n), -1, np.int32)
        accepted[slot, : len(path)] = path
        num = np.array([0, len(path)], np.int32)
        emitted = np.full((2, n + 1), -1, np.int32)
        emitted[slot, : len(path) + 1] = committed[before:]
        drafter.commit(active, accepted, num, emitted)
    assert accepted_total >= 15


@pytest.mark.parametrize(
    "shape,kernel",
    [pytest.param("chain", "xla", marks=pytest.mark.slow), ("wide", "xla"),
     pytest.param("wide", "megakernel", marks=pytest.mark.slow)],
)  # fmt: skip
def test_every_tree_in_the_engine_equals_a_fresh_forward(pair, shape, kernel):
    """Through LLM.generate, with the verify's own features: every 3rd tree equals a
    fresh forward's. "megakernel": the verify kernel (Pallas interpret mode) returns
    the features."""
    spec = SHAPES["chain"] if shape == "chain" else dict(num_speculative_tokens=24, max_depth=3,
                                                         topk=6)  # fmt: skip
    llm = dflash_llm(pair, max_num_seqs=4, kernel=kernel, **spec)
    assert llm.kernel == kernel
    engine = llm.engine
    drafter = engine.drafter
    assert isinstance(drafter, BlockDrafter)
    seen = []
    propose = drafter.propose

    def spy(active, roots, sampling):
        tree = propose(active, roots, sampling)
        for s in np.flatnonzero(active):
            seq = engine.slots[s]
            committed = [*seq.prompt_token_ids, *seq.output_ids]
            seen.append((committed, np.asarray(tree.tokens)[s], np.asarray(tree.parents)[s]))
        return tree

    drafter.propose = spy
    prompts = [{"prompt_token_ids": [int(t) for t in np.arange(n) * 7 % VOCAB]}
               for n in (1, 5, 13, 30, 9, 21)]  # fmt: skip
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    dcfg, dparams = dflash.load(pair[1])
    tcfg, tparams = load_model(pair[0])
    for committed, tokens, parents in seen[::3]:
        want_t, want_p = fresh_tree(dcfg, dparams, tcfg, tparams, committed, drafter)
        np.testing.assert_array_equal(parents, want_p)
        np.testing.assert_array_equal(tokens, want_t)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    llm = LLM(str(pair[0]), max_model_len=MAX_LEN, max_num_seqs=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [*sorted(SHAPES), "dflash2_tree", "vocab_tree"])
def test_greedy_equals_plain_decoding_on_100_prompts(pair, pair2, pair_vocab, prompts, reference,
                                                     shape):  # fmt: skip
    if shape == "dflash2_tree":
        pair, shape = pair2, "tree"
    if shape == "vocab_tree":
        pair, shape = pair_vocab, "tree"
    llm = dflash_llm(pair, **SHAPES[shape])
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == reference
    assert llm.get_metrics()["num_accepted_tokens"] > 20  # some drafts were right


@pytest.mark.slow
def test_first_two_tokens_follow_the_target(pair):
    """5,000 seeded requests at temperature 1 through a DFlash tree: each of the first
    two tokens' counts match the target's own marginals."""
    llm = dflash_llm(pair, max_num_seqs=64, max_model_len=32, **SHAPES["tree"])
    prompt = [3, 1, 4, 1, 5]
    n = 5000
    sp = [SamplingParams(max_tokens=2, ignore_eos=True, seed=i, temperature=1.0) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    assert toks.shape == (n, 2)
    assert llm.get_metrics()["num_accepted_tokens"] > 0.05 * n  # drafts were accepted
    assert_first_two_tokens_follow_the_target(pair[0], llm.config, prompt, toks)


@pytest.mark.slow
def test_seeded_requests_repeat_in_any_batch(pair):
    llm = dflash_llm(pair, **SHAPES["tree"])
    p = {"prompt_token_ids": [3, 1, 4, 1, 5, 9]}
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": [2, 7]}, p, p], [other, sp, sp], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone == batch[2].outputs[0].token_ids


# ----------------------------------------------------------------------------- refusals


def test_bad_dflash_configurations_are_refused(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="needs model=<DFlash drafter folder>"):
        LLM(str(target), speculative_config={"method": "dflash"})
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(tmp_path / "x")})
    write_dflash(tmp_path / "wide", vocab=VOCAB, hidden=48, layers=1, target_layer_ids=(0,),
                 num_target_layers=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"hidden size \(48\) differs from the target's \(32\)"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(tmp_path / "wide")})
    write_dflash(tmp_path / "deep", vocab=VOCAB, layers=1, target_layer_ids=(0, 5),
                 num_target_layers=6)  # fmt: skip
    with pytest.raises(ValueError, match=r"\[5\] are outside this target's 2 layers"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(tmp_path / "deep")})
    with pytest.raises(ValueError, match="method='dflash' runs in process for now"):
        LLM(str(target), distributed_executor_backend="ray",
            speculative_config={"method": "dflash", "model": str(drafter)})  # fmt: skip


def test_bad_draft_vocabularies_are_refused(pair, tmp_path):
    target, drafter = pair

    def variant(name, ids, **config):
        folder = tmp_path / name
        write_dflash(folder, vocab=VOCAB, layers=1, target_layer_ids=(0, 1),
                     num_target_layers=2, block_size=6, mask_token_id=5)  # fmt: skip
        add_draft_vocab(folder, ids)
        cfg = json.loads((folder / "config.json").read_text()) | config
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    with pytest.raises(ValueError, match="the tensor 'd2t' is missing"):
        cfg = json.loads((drafter / "config.json").read_text()) | {"draft_vocab_size": 4}
        (tmp_path / "nod2t").mkdir()
        (tmp_path / "nod2t" / "config.json").write_text(json.dumps(cfg))
        for f in drafter.glob("*.safetensors"):
            (tmp_path / "nod2t" / f.name).write_bytes(f.read_bytes())
        dflash.load(tmp_path / "nod2t")
    with pytest.raises(ValueError, match="4 distinct token ids in"):
        dflash.load(variant("dup", [1, 2, 2, 3]))
    with pytest.raises(ValueError, match=r"d2t must be 5 integers; got int64\[4\]"):
        dflash.load(variant("short", [1, 2, 3, 4], draft_vocab_size=5))
    with pytest.raises(ValueError, match=r"draft_vocab_size 99 must be in \[1, vocab_size=24\]"):
        dflash.load(variant("big", [1, 2, 3, 4], draft_vocab_size=99))
    # The whole vocabulary as a draft vocabulary is no draft vocabulary at all.
    dcfg, params = dflash.load(variant("all", list(range(VOCAB))))
    assert dcfg.draft_vocab_size == 0 and "vocab_ids" not in params


def test_draft_vocab_offsets_round_trip():
    ids = np.array([0, 3, 4, 9, 23])
    np.testing.assert_array_equal(dflash.draft_vocab_offsets(ids), [0, 2, 2, 6, 19])


def test_max_depth_is_capped_by_the_block(pair):
    llm = dflash_llm(pair, num_speculative_tokens=40, max_depth=9, topk=2)
    d = llm.engine.drafter
    assert d.max_depth == 5 and d.max_nodes == 40  # block_size 6: 5 positions after the root
    assert (llm.tree.num_nodes, llm.tree.max_depth, llm.tree.topk) == (40, 5, 2)  # as grown
