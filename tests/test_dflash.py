"""DFlash block drafters (`specdec.draft.dflash`) against the `dflash` package's torch
models (a test-only dependency, installed without its pinned dependencies): a tiny
random drafter written by its own `save_pretrained`, loaded by ours, gives the same
hidden states and logits for the same target features and block."""

from __future__ import annotations

import json

import dflash.model as dflash_pkg  # the reference: `pip install --no-deps dflash`
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_models import write_dflash

from specdec.draft import dflash

D, VOCAB = 32, 96


def write_drafter(folder, *, target_ids=(1, 3), **kw):
    return write_dflash(folder, vocab=VOCAB, hidden=D, target_layer_ids=target_ids, **kw)


def inputs(n_target_layers, batch=2, ctx=5, q=8, seed=1):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((batch, ctx, n_target_layers * D)).astype(np.float32)
    block = rng.standard_normal((batch, q, D)).astype(np.float32)
    start = rng.integers(0, 40, batch)
    pos = (start[:, None] + np.arange(ctx + q)[None]).astype(np.int64)
    return feats, block, pos


def both_forwards(model, dcfg, params):
    """(ours, the package's) final hidden states for the same random features and block."""
    feats, block, pos = inputs(len(dcfg.target_layer_ids))
    with torch.no_grad():
        want = model(position_ids=torch.from_numpy(pos), noise_embedding=torch.from_numpy(block),
                     target_hidden=torch.from_numpy(feats)).numpy()  # fmt: skip
    ctx = dflash.context_rows(dcfg, params, jnp.asarray(feats))
    got = dflash.forward(dcfg, params, ctx, jnp.asarray(block), jnp.asarray(pos))
    return np.asarray(got), want


@pytest.mark.parametrize("nested", [True, False])
def test_hidden_states_and_logits_match_the_package(tmp_path, nested):
    model = write_drafter(tmp_path / "d", nested=nested)
    dcfg, params = dflash.load(tmp_path / "d")
    assert dcfg.target_layer_ids == (1, 3) and dcfg.block_size == 8 and dcfg.mask_token_id == 7
    got, want = both_forwards(model, dcfg, params)
    assert got.shape == want.shape == (2, 8, D)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Logits through a shared head: the package's compute_logits (multiplier, soft cap).
    head = torch.nn.Linear(D, VOCAB, bias=False)
    with torch.no_grad():
        want_logits = model.compute_logits(torch.from_numpy(want), head).numpy()
        head_w = head.weight.numpy().T
    got_logits = np.asarray(dflash.draft_logits(dcfg, jnp.asarray(got) @ head_w))
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=0)


def test_multiplier_soft_cap_and_derived_layer_ids(tmp_path):
    """output_multiplier and final_logit_softcapping as the package applies them; no
    target_layer_ids: the package's rule from num_target_layers."""
    model = write_drafter(tmp_path / "d", layers=3, target_ids=(0, 1, 2),
                          output_multiplier=2.0, final_logit_softcapping=5.0)  # fmt: skip
    cfg_file = tmp_path / "d" / "config.json"
    hf = json.loads(cfg_file.read_text())
    del hf["dflash_config"]["target_layer_ids"]
    cfg_file.write_text(json.dumps(hf))
    dcfg, _ = dflash.load(tmp_path / "d")
    assert list(dcfg.target_layer_ids) == dflash_pkg.build_target_layer_ids(6, 3) == [1, 2, 3]
    logits = np.random.default_rng(0).standard_normal((2, 4, VOCAB)).astype(np.float32) * 9
    want = model.compute_logits(torch.from_numpy(logits), torch.nn.Identity()).numpy()
    got = np.asarray(dflash.draft_logits(dcfg, jnp.asarray(logits)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(got).max() <= 5.0 < np.abs(2.0 * logits).max()  # the cap bites


def test_bad_folders_are_refused_by_name(tmp_path):
    write_drafter(tmp_path / "d")
    cfg_file = tmp_path / "d" / "config.json"
    hf = json.loads(cfg_file.read_text())
    for change, match in [
        ({"architectures": ["Qwen3ForCausalLM"]}, "Not a DFlash drafter"),
        ({"architectures": ["DFlash2DraftModel"]}, "A DFlash2 config needs positive"),
        ({"dflash_config": {"block_size": 8, "target_layer_ids": [1, 3]}}, "mask_token_id"),
    ]:
        cfg_file.write_text(json.dumps(hf | change))
        with pytest.raises(ValueError, match=match):
            dflash.load(tmp_path / "d")
    cfg_file.write_text(json.dumps(hf | {"dflash_config": hf["dflash_config"] |
                                         {"target_layer_ids": [1, 2, 3]}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"3 target layers of width 32 need \(96, 32\)"):
        dflash.load(tmp_path / "d")


V2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 6}


@pytest.mark.parametrize("causal", [False, True])
def test_dflash2_hidden_states_logits_and_selector_match_the_package(tmp_path, causal):
    """DFlash2: the dynamic convolutions (hidden states and logits within 1e-4), the
    selector's scores after any previous token, and its greedy path from an anchor
    (the package's `propose` at temperature 0)."""
    extra = {"is_causal": True} if causal else {}
    model = write_drafter(tmp_path / "d", v2=V2, **extra)
    dcfg, params = dflash.load(tmp_path / "d")
    assert dcfg.is_dflash2 and dcfg.selector_top_k == 6 and dcfg.conv_kernel_size == 3
    got, want = both_forwards(model, dcfg, params)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    head = torch.nn.Linear(D, VOCAB, bias=False)
    rows = torch.from_numpy(want[:, 1:])  # the rows after the anchor, as the package passes
    anchor = torch.tensor([3, 50])
    with torch.no_grad():
        want_logits = model.compute_logits(rows, head).numpy()
        path, _, _ = model.propose(rows, anchor, head, 0.0)
        head_w = head.weight.numpy().T
    logits = dflash.draft_logits(dcfg, jnp.asarray(got[:, 1:]) @ head_w)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)
    unary, cand, proj = dflash.selector_inputs(dcfg, params, jnp.asarray(got[:, 1:]), logits)
    sel = model.candidate_selector
    prev = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 7)))
    with torch.no_grad():  # the package's score for the same candidates
        p_cb = sel.predecessor_codebook(torch.from_numpy(np.array(prev)))
        h = sel.hidden_projection(rows)
        s_cb = sel.successor_codebook(torch.from_numpy(np.array(cand)))
        want_scores = torch.from_numpy(np.array(unary)) + torch.einsum(
            "bpr,bpkr->bpk", p_cb * h, s_cb)  # fmt: skip
    got_scores = dflash.selector_scores(params, unary, cand, proj, prev)
    np.testing.assert_allclose(np.asarray(got_scores), want_scores.numpy(), atol=1e-4, rtol=0)
    previous = jnp.asarray(anchor.numpy())
    chain = []
    for p in range(7):
        s = dflash.selector_scores(params, unary[:, p], cand[:, p], proj[:, p], previous)
        previous = jnp.take_along_axis(cand[:, p], jnp.argmax(s, -1)[:, None], 1)[:, 0]
        chain.append(np.asarray(previous))
    np.testing.assert_array_equal(np.stack(chain, 1), path.numpy())
