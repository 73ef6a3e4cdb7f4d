"""Speculative decoding through LLM.generate: exactness, acceptance, seeds, stop rules."""

import math

import numpy as np
import pytest
from fixtures import tiny_config, tiny_pair, write_model

from specdec import LLM, SamplingParams

MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def assert_first_two_tokens_follow_the_target(target, cfg, prompt, toks) -> None:
    """toks i32[n, 2], the first two sampled tokens (temperature 1) of n requests for
    `prompt` to the model at `target`: each position's counts match the target's
    marginal (chi-square p > 1e-3; the second token's total variation at noise level)."""
    import jax.numpy as jnp

    from specdec.checkpoint import load_model
    from specdec.kernels.transformer import prefill_logits
    from specdec.verify.sampling import sampling_probs

    _, weights = load_model(target)
    v, n = cfg.vocab_size, len(toks)
    seqs = np.array([prompt + [t] for t in range(v)])
    logits = prefill_logits(weights, cfg, seqs, np.full(v, len(prompt) + 1))
    probs = lambda lg: np.asarray(  # noqa: E731
        sampling_probs(lg, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0))
    )
    p1 = probs(logits[0, len(prompt) - 1])
    p2 = p1 @ probs(logits[:, len(prompt)])
    c1, c2 = np.bincount(toks[:, 0], minlength=v), np.bincount(toks[:, 1], minlength=v)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    assert 0.5 * np.abs(c2 / n - p2).sum() < 3 * math.sqrt(v / n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def unrelated_dir(tmp_path_factory):
    """Same tokenizer, independent random weights."""
    return tiny_pair(tmp_path_factory.mktemp("unrelated"), seed=7)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 100)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def reference(target_dir, prompts):
    llm = LLM(target_dir, max_model_len=MAX_LEN, max_num_seqs=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def spec_llm(target_dir, draft_dir=None, **spec):
    if draft_dir is not None:
        spec = {"method": "draft_model", "model": str(draft_dir), **spec}
    return LLM(target_dir, max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec)


SHAPES = {
    "model_chain": dict(num_speculative_tokens=5, max_depth=5, topk=1),
    "model_tree": dict(num_speculative_tokens=16, max_depth=5, topk=3),
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equality_identical_draft(target_dir, prompts, reference, shape):
    llm = spec_llm(target_dir, target_dir, **SHAPES[shape])
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == reference
    m = llm.get_metrics()
    k = SHAPES[shape]["max_depth"]
    # Draft == target: every chain token is accepted.
    assert m["acceptance_length"] >= 0.98 * (k + 1)
    if shape == "model_chain":
        assert m["acceptance_rate"] >= 0.98


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equality_unrelated_draft(target_dir, unrelated_dir, prompts, reference, shape):
    llm = spec_llm(target_dir, unrelated_dir, **SHAPES[shape])
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == reference
    assert llm.get_metrics()["acceptance_rate"] < 0.1


def spy_verify_widths(target) -> list[int]:
    """The width of every tree `target` verifies from now on, in order."""
    verify, widths = target._verify, []

    def spy(r, roots, tree, *args):
        widths.append(tree.tokens.shape[1])
        return verify(r, roots, tree, *args)

    target._verify = spy
    return widths


@pytest.mark.slow
@pytest.mark.parametrize(("max_depth", "topk"), [(4, 1), (4, 3)])
def test_greedy_equality_ngram(target_dir, prompts, reference, max_depth, topk):
    llm = spec_llm(
        target_dir, method="ngram", num_speculative_tokens=8, max_depth=max_depth, topk=topk
    )
    widths = spy_verify_widths(llm.engine.target)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    # Steps without a match verify no tree; the others the narrowest width that holds it.
    assert 0 in widths and set(widths) <= {0, 4, 8} and len(set(widths)) > 1


@pytest.mark.slow
def test_greedy_equality_ngram_truncated_by_cost(target_dir, prompts, reference):
    """Where a wide verify costs more than its nodes win (`workers.WidthChooser`), host
    trees are cut to a narrower width, or not verified at all: outputs unchanged."""
    llm = spec_llm(target_dir, method="ngram", num_speculative_tokens=8, max_depth=8, topk=2)
    target = llm.engine.target
    costs = {4: 1.2, 8: 50.0}  # as if 9 rows cost 50 decode steps
    target.widths.cost = costs.__getitem__  # a plan's `width_cost`, as timed on some machine
    choose, cuts = target.widths.choose, []

    def spy(parents, active):
        width = choose(parents, active)
        cuts.append((parents.shape[1], width))
        return width

    target.widths.choose = spy
    widths = spy_verify_widths(target)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == reference
    assert (8, 4) in cuts and all(w <= 4 for _, w in cuts)
    assert set(widths) == {0, 4}  # what was verified is what was chosen
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    costs[4] = 50.0  # nothing pays: plain decoding, same tokens
    before = llm.get_metrics()["num_accepted_tokens"]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts[:20], GREEDY, use_tqdm=False)]
    assert out == reference[:20]
    assert llm.get_metrics()["num_accepted_tokens"] == before and cuts[-1][1] == 0


@pytest.mark.slow
def test_tree_reaches_chain_acceptance_length(target_dir, prompts):
    few = prompts[:8]
    chain = spec_llm(target_dir, target_dir, num_speculative_tokens=4, max_depth=4, topk=1)
    tree = spec_llm(target_dir, target_dir, num_speculative_tokens=12, max_depth=4, topk=3)
    chain.generate(few, GREEDY, use_tqdm=False)
    tree.generate(few, GREEDY, use_tqdm=False)
    assert tree.get_metrics()["acceptance_length"] >= chain.get_metrics()["acceptance_length"]


# ----------------------------------------------------------------------------- stop rules


@pytest.fixture(scope="module")
def spec_and_ref(target_dir, prompts, reference):
    return spec_llm(target_dir, target_dir, **SHAPES["model_tree"]), prompts[:6], reference[:6]


@pytest.mark.slow
def test_eos_inside_accepted_run(spec_and_ref):
    llm, ps, ref = spec_and_ref
    for p, r in zip(ps, ref, strict=True):
        eos = r[3]  # inside the first accepted run (acceptance length 6 here)
        llm.engine.eos_token_ids = frozenset([eos])
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        assert out[0].outputs[0].token_ids == r[: r.index(eos) + 1]
        assert out[0].outputs[0].finish_reason == "stop"
    llm.engine.eos_token_ids = frozenset()


@pytest.mark.slow
def test_stop_token_inside_accepted_run(spec_and_ref):
    llm, ps, ref = spec_and_ref
    for p, r in zip(ps, ref, strict=True):
        stop = r[2]
        params = SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop]
        )
        out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == r[: r.index(stop) + 1]
        assert out.stop_reason == stop


def test_stop_string_spanning_accepted_tokens(target_dir):
    llm = spec_llm(target_dir, target_dir, **SHAPES["model_tree"])
    tok = llm.tokenizer
    prompt = "def fib(n):"
    r = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    full = tok.decode(r)
    for k in range(2, len(r) - 1):  # first clean boundary between tokens k-1 and k
        left, both = tok.decode(r[:k]), tok.decode(r[: k + 1])
        if left and len(both) > len(left) and full.startswith(both):
            stop = left[-1] + both[len(left)]
            if "\ufffd" not in stop:
                break
    n = next(j for j in range(1, len(r) + 1) if stop in tok.decode(r[:j]))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == r[:n]
    assert out.text == full[: full.index(stop)]


@pytest.mark.slow  # the engine's logic is in test_engine_logic.py (mocks); this on a model
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_never_exceeded(spec_and_ref, max_tokens):
    llm, ps, ref = spec_and_ref
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for o, r in zip(llm.generate(ps, params, use_tqdm=False), ref, strict=True):
        assert o.outputs[0].token_ids == r[:max_tokens]
        assert o.outputs[0].finish_reason == "length"
    sampled = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3)
    for o in llm.generate(ps, sampled, use_tqdm=False):
        assert len(o.outputs[0].token_ids) == max_tokens


# ----------------------------------------------------------------------------- seeds


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_determinism_and_batch_invariance(target_dir, unrelated_dir, prompts, method):
    if method == "draft_model":
        llm = spec_llm(target_dir, unrelated_dir, **SHAPES["model_tree"])
    else:
        llm = spec_llm(target_dir, method="ngram", num_speculative_tokens=8, topk=2)
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=16, seed=77)
    alone = llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(20):
        assert llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids == alone
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(7)]
    batch = llm.generate(prompts[1:4] + [prompts[0]] + prompts[4:8], others[:3] + [p] + others[3:])
    assert batch[3].outputs[0].token_ids == alone


# ----------------------------------------------------------------------------- distribution


def chi2_sf(stat: float, dof: int) -> float:
    from jax.scipy.special import gammaincc

    return float(gammaincc(dof / 2.0, stat / 2.0))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square, cells with expected count < 5 pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """Vocabulary 24, peaky target; draft = the same weights less peaky (partial agreement)."""
    root = tmp_path_factory.mktemp("small")
    cfg = tiny_config(24, num_layers=1)
    target = write_model(root / "t", cfg, seed=3, scale=60.0)
    draft = write_model(root / "d", cfg, seed=3, scale=30.0)
    return target, draft


def small_vocab_llm(target_dir, draft_dir):
    return LLM(
        target_dir, max_model_len=32, max_num_seqs=64,
        speculative_config={"method": "draft_model", "model": str(draft_dir),
                            "num_speculative_tokens": 8, "max_depth": 3, "topk": 2},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=8, top_p=0.9),
        dict(temperature=1.5, min_p=0.05),
    ],
)
def test_first_two_tokens_match_target_marginals(small_vocab_pair, params):
    """>= 5k seeded requests through LLM.generate with a real draft model."""
    import jax.numpy as jnp

    from specdec.kernels.transformer import prefill_logits
    from specdec.verify.sampling import sampling_probs

    target_dir, draft_dir = small_vocab_pair
    llm = small_vocab_llm(target_dir, draft_dir)
    prompt = [3, 1, 4, 1, 5]
    n = 5000
    sp = [SamplingParams(max_tokens=2, ignore_eos=True, seed=i, **params) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    assert toks.shape == (n, 2)
    assert llm.get_metrics()["num_accepted_tokens"] > 0.05 * n  # drafts were accepted

    # Exact marginals from the target's own logits.
    v = llm.config.vocab_size
    from specdec.checkpoint import load_model

    cfg, weights = load_model(target_dir)
    seqs = np.array([prompt + [t] for t in range(v)])
    logits = prefill_logits(weights, cfg, seqs, np.full(v, len(prompt) + 1))
    probs = lambda lg: np.asarray(  # noqa: E731
        sampling_probs(
            lg, jnp.float32(params.get("temperature", 1.0)), jnp.int32(params.get("top_k", 0)),
            jnp.float32(params.get("top_p", 1.0)), jnp.float32(params.get("min_p", 0.0)),
        )
    )  # fmt: skip
    p1 = probs(logits[0, len(prompt) - 1])  # [V]
    p2_given = probs(logits[:, len(prompt)])  # [V, V]
    p2 = p1 @ p2_given
    c1 = np.bincount(toks[:, 0], minlength=v)
    c2 = np.bincount(toks[:, 1], minlength=v)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    # And the total-variation distance is at noise level.
    assert 0.5 * np.abs(c2 / n - p2).sum() < 3 * math.sqrt(v / n)


@pytest.mark.slow
def test_metrics_per_call_and_running_totals(target_dir, prompts):
    llm = spec_llm(target_dir, target_dir, num_speculative_tokens=4, max_depth=4, topk=1)
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    call = llm.last_generate_metrics
    total = llm.get_metrics()
    per_request = sum(o.metrics.spec.num_accepted_tokens for o in outs)
    assert call["num_accepted_tokens"] == total["num_accepted_tokens"] == per_request
    assert call["num_output_tokens"] == 3 * 24 and call["tokens_per_s"] > 0
    assert call["mean_ttft"] >= 0 and call["mean_tpot"] >= 0
    # Chain of 4 with draft == target: every step accepts 4 and adds the bonus token.
    assert call["acceptance_length"] == 5.0
    assert call["per_position_acceptance_rate"] == [1.0, 1.0, 1.0, 1.0]
    llm.generate(prompts[3:4], GREEDY, use_tqdm=False)
    assert (
        llm.get_metrics()["num_drafts"]
        == total["num_drafts"] + llm.last_generate_metrics["num_drafts"]
    )


@pytest.mark.slow
def test_a_request_reads_one_kv_length_from_start_to_end(target_dir, prompts, monkeypatch):
    """Its planned length (prompt + max_tokens + tree) is reserved at admission, so a
    request crossing the 128-position floor compiles no second KV variant."""
    from specdec.kernels import runner as kv_runner

    seen = []
    real = kv_runner.ModelRunner.kv_len
    monkeypatch.setattr(
        kv_runner.ModelRunner, "kv_len", lambda self, *a: seen.append(real(self, *a)) or seen[-1]
    )
    long = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)
    llm = LLM(target_dir, max_model_len=256, max_num_seqs=2, speculative_config={
        "method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 4,
        "max_depth": 4, "topk": 1})  # fmt: skip
    spec = llm.generate([prompts[0]], long, use_tqdm=False)[0].outputs[0].token_ids
    assert set(seen) == {256}, sorted(set(seen))  # prompt + 140 + tree <= 256: one variant
    ar = LLM(target_dir, max_model_len=256, max_num_seqs=2)
    assert spec == ar.generate([prompts[0]], long, use_tqdm=False)[0].outputs[0].token_ids
    # Released rows reserve nothing: a short request afterwards reads the floor.
    seen.clear()
    llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    assert set(seen) == {128}


def test_reservations_are_capped():
    from specdec.kernels.runner import KV_RESERVE_CAP, ModelRunner

    cfg = tiny_config()
    import jax

    from specdec.kernels.transformer import init_params

    r = ModelRunner(cfg, init_params(cfg, jax.random.key(0)), num_slots=2, max_len=4096)
    rows = np.array([True, False])
    assert r.kv_len(rows, 10) == 128
    r.reserve([0], [300])
    assert r.kv_len(rows, 10) == 384 and r.kv_len(~rows, 10) == 128
    r.reserve([0], [100_000])
    assert r.kv_len(rows, 10) == KV_RESERVE_CAP and r.kv_len(rows, 1500) == 1536
    r.release(0)
    assert r.kv_len(rows, 10) == 128


def test_kv_bucket_quarter_octaves():
    from specdec.kernels.runner import kv_bucket

    # A quarter of the octave below n, never under the floor: 530 -> step 512 / 4 = 128.
    cases = {1: 128, 128: 128, 129: 256, 300: 384, 512: 512, 513: 640, 530: 640,
             1024: 1024, 1025: 1280, 1500: 1536, 3000: 3072}  # fmt: skip
    for needed, want in cases.items():
        assert kv_bucket(needed, 1 << 20) == want, needed
    assert kv_bucket(530, 600) == 600  # capped at max_len
    assert kv_bucket(np.int64(530), 4096) == 640  # numpy integers too
    for needed in range(1, 5000, 7):  # never short; over by less than the floor or 25%
        got = kv_bucket(needed, 1 << 20)
        assert needed <= got < needed + max(128, needed / 4)


# ----------------------------------------------------------------------------- repetition penalty

PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)


@pytest.fixture(scope="module")
def penalized_reference(target_dir, prompts):
    llm = LLM(target_dir, max_model_len=MAX_LEN, max_num_seqs=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts[:12], PENALIZED, use_tqdm=False)]


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(
            dict(draft="same", num_speculative_tokens=5, max_depth=5, topk=1),
            marks=pytest.mark.slow,
        ),
        # CI only (the quick subset keeps the penalty's seeded determinism test):
        # its reference engine is another 7 s to build.
        pytest.param(
            dict(draft="same", num_speculative_tokens=16, max_depth=5, topk=3),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(draft="unrelated", num_speculative_tokens=8, max_depth=4, topk=2),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(method="ngram", num_speculative_tokens=8, max_depth=4, topk=2),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["chain", "tree", "unrelated_tree", "ngram"],
)
def test_repetition_penalty_greedy_equals_ar(
    target_dir, unrelated_dir, prompts, reference, penalized_reference, spec
):
    spec = dict(spec)
    draft = {"same": target_dir, "unrelated": unrelated_dir}.get(spec.pop("draft", None))
    llm = spec_llm(target_dir, draft, **spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:12], PENALIZED, use_tqdm=False)]
    assert got == penalized_reference
    assert got != reference[:12]  # the penalty changed outputs: this test can fail


@pytest.mark.slow  # CI only: the quick subset's penalty coverage is test_sampling's
def test_repetition_penalty_seeded_determinism(target_dir, unrelated_dir, prompts):
    llm = spec_llm(target_dir, unrelated_dir, **SHAPES["model_tree"])
    p = SamplingParams(temperature=0.8, max_tokens=16, seed=5, repetition_penalty=1.3)
    alone = llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids == alone
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(3)]
    batch = llm.generate(prompts[1:4] + [prompts[0]], others + [p], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone


@pytest.mark.slow
def test_repetition_penalty_first_two_tokens_match_target_marginals(small_vocab_pair):
    """Sampling with a penalty: the second token's context holds the first (a tree path).
    3k seeded requests: the penalty moves these marginals far past chi-square's noise."""
    import jax.numpy as jnp

    from specdec.checkpoint import load_model
    from specdec.kernels.transformer import prefill_logits
    from specdec.verify.sampling import sampling_probs

    target_dir, draft_dir = small_vocab_pair
    llm = small_vocab_llm(target_dir, draft_dir)
    # This target's logits are small: a low temperature makes the penalty matter.
    prompt, pen, temp, n = [3, 1, 4, 1, 5], 3.0, 0.1, 3000
    sp = [
        SamplingParams(max_tokens=2, ignore_eos=True, seed=i, temperature=temp,
                       repetition_penalty=pen)
        for i in range(n)
    ]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    assert llm.get_metrics()["num_accepted_tokens"] > 0.05 * n

    v = llm.config.vocab_size
    cfg, weights = load_model(target_dir)
    seqs = np.array([prompt + [t] for t in range(v)])
    logits = np.asarray(prefill_logits(weights, cfg, seqs, np.full(v, len(prompt) + 1)))

    def penalized(lg, context):
        lg = lg.copy()
        for t in set(context):
            lg[..., t] = lg[..., t] / pen if lg[..., t] > 0 else lg[..., t] * pen
        return np.asarray(sampling_probs(jnp.asarray(lg), temp, 0, 1.0, 0.0))

    p1 = penalized(logits[0, len(prompt) - 1], prompt)
    p2_given = np.stack([penalized(logits[t, len(prompt)], prompt + [t]) for t in range(v)])
    p2 = p1 @ p2_given
    plain = np.asarray(sampling_probs(jnp.asarray(logits[0, len(prompt) - 1]), temp, 0, 1.0, 0))
    assert 0.5 * np.abs(plain - p1).sum() > 0.03  # the penalty moves it (chi2 can tell)
    c1 = np.bincount(toks[:, 0], minlength=v)
    c2 = np.bincount(toks[:, 1], minlength=v)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    assert 0.5 * np.abs(c2 / n - p2).sum() < 3 * math.sqrt(v / n)
