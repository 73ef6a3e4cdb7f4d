"""Damaged checkpoints: a truncated or corrupt weight file, a lost shard, a broken index,
a missing or misshapen tensor each raise a plain ValueError naming the file and the
defect (never a raw SafetensorError, KeyError or JSONDecodeError), for the target and the
draft alike; and `specdec generate` turns it into one `error:` line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from fixtures import tiny_pair
from safetensors.numpy import load_file, save_file

from specdec.checkpoint import load_model, save_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """A tiny single-file model (with a tokenizer) and the same weights in shards."""
    single = tiny_pair(tmp_path_factory.mktemp("single"))
    cfg, params = load_model(single)
    sharded = tmp_path_factory.mktemp("sharded")
    save_checkpoint(sharded, cfg, params, dtype="float32", max_shard_bytes=30_000)
    assert len(set(json.loads((sharded / INDEX).read_text())["weight_map"].values())) >= 3
    return {"single": single, "sharded": sharded}


def _copy(pristine: dict, which: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine[which], tmp_path / which))


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def _load_error(folder: Path) -> str:
    with pytest.raises(ValueError) as info:
        load_model(folder)
    # Not a JSONDecodeError (a ValueError subclass) nor any other library error.
    assert type(info.value) is ValueError, type(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------- damage


def truncate(keep: int):
    """Cuts the file to `keep` bytes (negative: drops -keep from the end)."""

    def damage(file: Path) -> None:
        data = file.read_bytes()
        file.write_bytes(data[:keep])

    return damage


def flip(start: int, stop: int):
    def damage(file: Path) -> None:
        data = bytearray(file.read_bytes())
        for i in range(start, stop):
            data[i] ^= 0xFF
        file.write_bytes(bytes(data))

    return damage


def garbage(file: Path) -> None:
    file.write_bytes(np.random.default_rng(0).bytes(file.stat().st_size))


FILE_DAMAGE = {
    "truncated data": truncate(-100),
    "truncated header": truncate(20),
    "shorter than its header length": truncate(5),
    "empty": truncate(0),
    "header bytes flipped": flip(12, 40),
    "header length flipped": flip(0, 8),
    "garbage": garbage,
    "trailing bytes": lambda f: f.write_bytes(f.read_bytes() + b"\0" * 16),
}


@pytest.mark.parametrize("damage", list(FILE_DAMAGE))
def test_damaged_single_file(pristine, tmp_path, damage):
    folder = _copy(pristine, "single", tmp_path)
    FILE_DAMAGE[damage](folder / "model.safetensors")
    message = _load_error(folder)
    assert str(folder / "model.safetensors") in message and "truncated or corrupt" in message
    assert "\n" not in message  # the CLI prints it as one line


@pytest.mark.parametrize("damage", ["truncated data", "header bytes flipped", "empty"])
def test_damaged_shard(pristine, tmp_path, damage):
    folder = _copy(pristine, "sharded", tmp_path)
    shard = _shards(folder)[1]
    FILE_DAMAGE[damage](folder / shard)
    message = _load_error(folder)
    assert str(folder / shard) in message and "truncated or corrupt" in message
    assert "\n" not in message


def test_lost_shard(pristine, tmp_path):
    folder = _copy(pristine, "sharded", tmp_path)
    shard = _shards(folder)[0]
    (folder / shard).unlink()
    assert f"missing shard files: {shard}" in _load_error(folder)


def test_index_points_at_a_missing_shard(pristine, tmp_path):
    folder = _copy(pristine, "sharded", tmp_path)
    index = json.loads((folder / INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    message = _load_error(folder)
    assert "missing shard files: model-00009-of-00009.safetensors" in message
    assert name in message


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(lambda t: t[: len(t) // 2], id="truncated"),
        pytest.param(lambda t: "", id="empty"),
        pytest.param(lambda t: t.replace('"weight_map"', "weight_map"), id="bad JSON"),
        pytest.param(lambda t: "\udcff", id="not UTF-8"),
    ],
)
def test_index_not_json(pristine, tmp_path, text):
    folder = _copy(pristine, "sharded", tmp_path)
    index = folder / INDEX
    raw = text(index.read_text())
    index.write_bytes(raw.encode("utf-8", "surrogateescape"))
    message = _load_error(folder)
    assert str(index) in message and "not valid JSON" in message


@pytest.mark.parametrize(
    "index",
    [
        pytest.param([1, 2], id="a list"),
        pytest.param({"metadata": {}}, id="no weight_map"),
        pytest.param({"weight_map": ["model-1.safetensors"]}, id="weight_map a list"),
        pytest.param({"weight_map": {"model.norm.weight": 3}}, id="a file name not a string"),
    ],
)
def test_index_without_a_weight_map(pristine, tmp_path, index):
    folder = _copy(pristine, "sharded", tmp_path)
    (folder / INDEX).write_text(json.dumps(index))
    message = _load_error(folder)
    assert str(folder / INDEX) in message and "weight_map" in message


def test_missing_and_misshapen_tensor(pristine, tmp_path):
    folder = _copy(pristine, "single", tmp_path)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, file)
    message = _load_error(folder)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in message
    assert "model.norm.weight has shape [7], expected [32]" in message


def test_damaged_draft_through_the_api(pristine, tmp_path):
    """The draft loads through the same reader: its damaged file is named too."""
    from specdec import LLM

    draft = _copy(pristine, "single", tmp_path)
    truncate(-100)(draft / "model.safetensors")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        LLM(str(pristine["single"]), max_model_len=64, max_num_seqs=1, speculative_config=spec)
    assert str(draft / "model.safetensors") in str(info.value)


def test_cli_truncated_target_is_one_error_line(pristine, tmp_path):
    folder = _copy(pristine, "single", tmp_path)
    truncate(-100)(folder / "model.safetensors")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECDEC_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--model", str(folder),
         "--method", "none", "--max-tokens", "2", "def fib(n):"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("specdec generate: error: Weight file ")
    assert str(folder / "model.safetensors") in errors[0]
    assert "Traceback" not in run.stderr and "SafetensorError" not in run.stderr


def test_undamaged_copies_still_load(pristine):
    """The fixtures themselves are sound (the damage above is what breaks them)."""
    cfg, single = load_model(pristine["single"])
    cfg_sharded, sharded = load_model(pristine["sharded"])
    assert cfg == cfg_sharded
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), single, sharded))
