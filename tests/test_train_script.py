"""scripts/train_demo_pair.py end to end on its --smoke settings (tiny models, a few steps)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.checkpoint import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_pair.py"
pytestmark = pytest.mark.slow


def _train(run_dir: Path, *args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--smoke", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return (run_dir / "progress.log").read_text()


def _params(ckpt: Path) -> dict[str, np.ndarray]:
    with np.load(ckpt) as z:
        return {k: z[k] for k in z.files if k.startswith("params/")}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("smoke_a")
    _train(run)
    return run


def test_all_stages_export_a_loadable_pair(full_run):
    export = full_run / "export"
    for name in ("target", "draft"):
        folder = export / name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
            assert (folder / f).is_file(), f
        cfg, params = load_model(folder, dtype="float32")
        # The export is the bf16 rounding of the last checkpoint: phase 2's target and
        # phase 3's draft.
        stage = "target_more" if name == "target" else "draft_final"
        stored = _params(full_run / f"{stage}.ckpt.npz")
        leaves = jax.tree_util.tree_leaves(params)
        assert len(leaves) == len(stored)
        for i, leaf in enumerate(leaves):
            want = np.asarray(stored[f"params/{i:04d}"], np.float32)
            want = want.astype(jnp.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(leaf, np.float32), want)
    gen = json.loads((export / "target" / "generation_config.json").read_text())
    assert gen["repetition_penalty"] == 1.2 and gen["do_sample"] is False
    from specdec.params import generation_defaults

    assert generation_defaults(export / "target") == {"repetition_penalty": 1.2}
    info = json.loads((export / "training.json").read_text())
    for key in ("target_fp32", "draft_fp32", "target_more_fp32", "draft_more_fp32",
                "draft_final_fp32"):  # fmt: skip
        assert np.isfinite(info[key]["loss"]), key
    settings = info["settings"]
    sd = settings["self_distill"]
    with np.load(full_run / "data" / "generated.npz") as z:
        tokens, top_ids, top_logp = z["tokens"], z["top_ids"], z["top_logp"]
    gen_len = sd["length"] - sd["prompt_len"]
    assert tokens.shape == (sd["num_sequences"], sd["length"])
    assert top_ids.shape == top_logp.shape == (len(tokens), gen_len, sd["teacher_topk"])
    assert info["generated"]["sequences"] == len(tokens)
    # Rows with no penalty (even rows) chose the raw distribution's top token.
    np.testing.assert_array_equal(tokens[::2, sd["prompt_len"] :], top_ids[::2, :, 0])
    assert np.all(np.diff(top_logp.astype(np.float32), axis=-1) <= 0)
    assert info["target_bf16"]["heldout_tokens"] > 0
    assert (export / "heldout_files.txt").read_text().strip()


def test_stage_by_stage_reproduces_the_run(full_run, tmp_path):
    _train(tmp_path, "--stage", "tokenizer")
    log = _train(tmp_path, "--stage", "target")
    assert "target step 30/30" in log
    a, b = _params(full_run / "target.ckpt.npz"), _params(tmp_path / "target.ckpt.npz")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    log = _train(tmp_path, "--stage", "target")  # finished: resumes and trains nothing
    assert log.count("target: resumed from") == 1 and log.count("target step 30/30") == 1


def test_phase1_from_an_export_seeds_phase2(full_run, tmp_path):
    _train(tmp_path, "--stage", "tokenizer")
    log = _train(tmp_path, "--phase1-from", str(full_run / "export"), "--stage", "target_more")
    assert "target: checkpoint seeded from" in log
    assert "target_more: done" in log
    seeded = _params(tmp_path / "target.ckpt.npz")
    with np.load(tmp_path / "target.ckpt.npz") as z:
        meta = json.loads(bytes(z["meta"]).decode())
    assert meta["done"] and meta["seeded_from"].endswith("target")
    assert len(seeded) > 0


def test_wrong_shape_export_is_refused(full_run, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # The full-size settings do not match the smoke export.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--run-dir", str(tmp_path), "--stage", "export",
         "--phase1-from", str(full_run / "export")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode != 0
    assert "is not this run's target shape" in out.stderr
    assert "Traceback" not in out.stderr


def test_phase2_from_an_export_runs_phase3_alone(full_run, tmp_path):
    _train(tmp_path, "--stage", "tokenizer")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(tmp_path), "--smoke",
           "--phase2-from", str(full_run / "export"), "--stage", "draft_final"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "run the generate stage first" in out.stderr
    log = (tmp_path / "progress.log").read_text()
    assert "target_more: checkpoint seeded from" in log
    assert "draft_more: checkpoint seeded from" in log
    log = _train(tmp_path, "--stage", "generate")
    log = _train(tmp_path, "--stage", "draft_final")
    assert "draft_final: done" in log
    # Phase 3's data depends on the target alone, which generates in bf16: the seeded
    # (bf16-rounded) phase-2 target writes what the full run's fp32 one did.
    for key in ("tokens", "top_ids"):
        with np.load(full_run / "data" / "generated.npz") as a:
            with np.load(tmp_path / "data" / "generated.npz") as b:
                np.testing.assert_array_equal(a[key], b[key])


def _script_module(name: str):
    """A module of scripts/ (they import each other by plain name)."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.parametrize("kv_step", [128, 4])  # 4: the read window grows mid-sequence
def test_greedy_continuations_match_a_cacheless_greedy_loop(kv_step, monkeypatch):
    """The KV-cached generation of phase 3's data against recomputing the whole
    sequence each step, with and without a repetition penalty."""
    from specdec.kernels.config import ModelConfig
    from specdec.kernels.transformer import forward_train, init_params, unstack_layers
    from specdec.verify.sampling import repetition_penalized

    mod = _script_module("demo_generate")
    monkeypatch.setattr(mod, "GEN_KV_STEP", kv_step)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    params = init_params(cfg, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda a: a * 4, params)  # peaked: fewer near-ties
    prompts = np.asarray(jax.random.randint(jax.random.key(4), (3, 5), 1, 64), np.int32)
    penalty = np.array([1.0, 1.5, 3.0], np.float32)
    got, logp, ids = mod.greedy_continuations(unstack_layers(params), prompts, penalty,
                                              cfg=cfg, gen_len=7, topk=3)  # fmt: skip
    got = np.asarray(got)
    seq = prompts.copy()
    for j in range(7):
        logits = forward_train(params, cfg, jnp.asarray(seq))[:, -1]
        want_logp, want_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), 3)
        np.testing.assert_array_equal(np.asarray(ids)[:, j], np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(logp)[:, j], np.asarray(want_logp), atol=1e-5)
        seen = np.zeros((3, cfg.vocab_size), bool)
        for b in range(3):
            seen[b, seq[b]] = True
        nxt = np.asarray(jnp.argmax(repetition_penalized(logits, seen, penalty[:, None]), -1))
        seq = np.concatenate([seq, nxt[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(got, seq[:, 5:])
    assert len(set(got[2].tolist())) == 7  # penalty 3 on a peaked model: no token twice


def test_rows_are_a_pure_function_of_their_index():
    Rows = _script_module("demo_corpus").Rows
    rows = np.arange(10)[:, None] * np.ones((1, 4), int)
    whole = np.stack([Rows(rows, seed=0, salt=1).sample(j) for j in range(30)])
    fresh = Rows(rows, seed=0, salt=1)  # resumed mid-way: the same samples
    np.testing.assert_array_equal(np.stack([fresh.sample(j) for j in range(17, 26)]), whole[17:26])
    for epoch in range(3):  # every row once per epoch, in a new order each time
        assert sorted(whole[epoch * 10 : epoch * 10 + 10, 0]) == list(range(10))
    assert not np.array_equal(whole[:10], whole[10:20])


def test_phase3_dtype_setting():
    """Phase 3's generation dtype: validated, and a run dir written before the
    setting existed resumes with what it used then (bfloat16)."""
    settings = _script_module("demo_settings")
    gen = _script_module("demo_generate")
    base = dataclasses.asdict(settings.default_settings(smoke=False))
    assert base["self_distill"]["dtype"] == "float32"
    sd = base["self_distill"]
    old = {**base, "self_distill": {k: v for k, v in sd.items() if k != "dtype"}}
    assert settings.RunSettings.from_json(old).self_distill.dtype == "bfloat16"
    bad = {**base, "self_distill": {**sd, "dtype": "float16"}}
    with pytest.raises(ValueError, match="self_distill.dtype must be bfloat16 or float32, got 'f"):
        settings.RunSettings.from_json(bad)
    # float32 generation steps run through Eigen on CPU; bfloat16 ones keep XLA's default.
    assert gen.step_library(jnp.float32) == "eigen"
    assert gen.step_library(jnp.bfloat16) == "default"


DFLASH_SCRIPT = SCRIPT.parent / "train_dflash.py"


def test_dflash_training_exports_a_drafter_both_loaders_read(tmp_path):
    """scripts/train_dflash.py --smoke on the bundled target: the export loads in
    specdec and in the `dflash` package (same forward), and drafts in the engine
    (greedy output equal to plain decoding); a rerun resumes instead of retraining."""
    import dflash.model as dflash_pkg
    import torch

    from specdec import LLM, SamplingParams
    from specdec.draft import dflash

    run, export = tmp_path / "run", tmp_path / "export"
    cmd = [sys.executable, str(DFLASH_SCRIPT), "--run-dir", str(run), "--export-dir",
           str(export), "--smoke"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    metrics = json.loads((export / "training.json").read_text())["heldout"]
    assert 0 <= metrics["greedy_chain_tokens_per_step"] <= 4
    dcfg, params = dflash.load(export)
    assert dcfg.block_size == 4 and dcfg.target_layer_ids == (0, 1)
    # The smoke run's draft vocabulary: the corpus's 256 most frequent tokens.
    assert dcfg.draft_vocab_size == 256 and params["vocab_ids"].shape == (256,)
    assert 0.3 < metrics["draft_vocab_coverage"] <= 1
    model = dflash_pkg.DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    d = dcfg.model.hidden_size
    feats = rng.standard_normal((1, 5, 2 * d)).astype(np.float32)
    block = rng.standard_normal((1, 4, d)).astype(np.float32)
    pos = np.arange(9)[None]
    with torch.no_grad():
        want = model(position_ids=torch.from_numpy(pos), noise_embedding=torch.from_numpy(block),
                     target_hidden=torch.from_numpy(feats)).numpy()  # fmt: skip
    ctx = dflash.context_rows(dcfg, params, jnp.asarray(feats))
    got = dflash.forward(dcfg, params, ctx, jnp.asarray(block), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    target = SCRIPT.parents[1] / "specdec" / "assets" / "demo" / "target"
    greedy = SamplingParams(temperature=0, max_tokens=12)
    spec = {"method": "dflash", "model": str(export), "num_speculative_tokens": 6, "max_depth": 3,
            "topk": 2}  # fmt: skip
    got = LLM(target, max_model_len=256, max_num_seqs=2, speculative_config=spec)
    plain = LLM(target, max_model_len=256, max_num_seqs=2)
    prompts = ["def fib(n):", "import os\n"]
    assert [o.outputs[0].token_ids for o in got.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "resumed from" in (run / "progress.log").read_text()
