"""scripts/train_demo_pair.py end to end on its --smoke settings (tiny models, a few steps)."""

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
        # The export is the bf16 rounding of the last (phase-2) checkpoint.
        stored = _params(full_run / f"{name}_more.ckpt.npz")
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
    for key in ("target_fp32", "draft_fp32", "target_more_fp32", "draft_more_fp32"):
        assert np.isfinite(info[key]["loss"]), key
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
    assert "phase-1 checkpoint seeded" in log
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
