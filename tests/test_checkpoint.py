"""Reading Hugging Face folders: config.json -> ModelConfig, safetensors -> params.

Covers the config fields of every family (transformers 5 keys and the older keys most
hub checkpoints still carry), the errors for what we do not support, and `load_model`'s
single ValueError naming every missing / unexpected / misshapen tensor and missing shard.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specdec.checkpoint import load_config, load_model, save_checkpoint

sys.path.insert(0, str(Path(__file__).parent))  # tests/ is not a package
import hf_models  # noqa: E402

hf_zoo = hf_models.hf_zoo

SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _edit_safetensors(file: Path, drop=(), put=None) -> None:
    """Rewrites one safetensors file without `drop` and with `put` (added or replaced)."""
    tensors = load_file(file)
    for name in drop:
        del tensors[name]
    tensors.update(put or {})
    save_file(tensors, file, metadata={"format": "pt"})


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _load_error(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        load_model(path)
    return str(info.value)


# ------------------------------------------------------------------------------ config


def _expected_fields(name: str) -> dict:
    """ModelConfig fields a variant must map to, from the kwargs it was built with."""
    v = hf_models.VARIANTS[name].config
    rope = v.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    heads = v["num_attention_heads"]
    fields = dict(
        vocab_size=v["vocab_size"],
        hidden_size=v["hidden_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=v["num_key_value_heads"],
        head_dim=v.get("head_dim", v["hidden_size"] // heads),
        rms_norm_eps=v["rms_norm_eps"],
        rope_theta=rope["rope_theta"],
        max_position_embeddings=v["max_position_embeddings"],
        tie_word_embeddings=v.get("tie_word_embeddings", False),
        attention_bias=hf_models.VARIANTS[name].family == "qwen2",
        qk_norm=hf_models.VARIANTS[name].family.startswith("qwen3"),
        num_experts=v.get("num_experts", 0),
        num_experts_per_tok=v.get("num_experts_per_tok", 0),
        norm_topk_prob=v.get("norm_topk_prob", False),
        sliding_window=v.get("sliding_window"),
    )
    if "num_experts" in v:
        fields["moe_intermediate_size"] = v["moe_intermediate_size"]
    else:
        fields["intermediate_size"] = v["intermediate_size"]
    return fields


@pytest.mark.parametrize(
    "name",
    [n for n, v in hf_models.VARIANTS.items() if v.family not in ("deepseek_v3", "kimi_linear")],
)
def test_load_config_fields(hf_zoo, name):
    cfg = load_config(hf_zoo[name])
    want = _expected_fields(name)
    got = {k: getattr(cfg, k) for k in want}
    assert got == want
    assert cfg.architecture.value == hf_models.read_config(hf_zoo[name])["architectures"][0]
    rope = hf_models.VARIANTS[name].config.get("rope_parameters", {})
    if rope.get("rope_type") == "llama3":
        s = cfg.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (8.0, 1.0, 4.0)
        assert s.original_max_position_embeddings == 64
    else:
        assert cfg.rope_scaling is None


def test_load_deepseek_v3_config_fields(hf_zoo):
    v = hf_models.VARIANTS["deepseek_v3"].config
    cfg = load_config(hf_zoo["deepseek_v3"])
    assert cfg.is_mla and cfg.num_kv_heads == 1 and cfg.head_dim == v["qk_rope_head_dim"]
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        v["kv_lora_rank"], v["q_lora_rank"], v["qk_nope_head_dim"], v["v_head_dim"])  # fmt: skip
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        v["n_routed_experts"], v["num_experts_per_tok"], v["moe_intermediate_size"])  # fmt: skip
    assert (cfg.scoring_func, cfg.expert_bias, cfg.n_group, cfg.topk_group) == (
        "sigmoid", True, v["n_group"], v["topk_group"])  # fmt: skip
    assert cfg.routed_scaling_factor == v["routed_scaling_factor"] and cfg.norm_topk_prob
    assert (cfg.n_shared_experts, cfg.first_k_dense_replace) == (1, 1)
    rs, want = cfg.rope_scaling, v["rope_parameters"]
    assert (rs.rope_type, rs.factor, rs.mscale, rs.mscale_all_dim) == (
        "yarn", want["factor"], want["mscale"], want["mscale_all_dim"])  # fmt: skip
    assert rs.original_max_position_embeddings == want["original_max_position_embeddings"]
    plain = load_config(hf_zoo["deepseek_v3_plain"])
    assert plain.q_lora_rank == 0 and plain.rope_scaling is None and plain.n_group == 1


def test_deepseek_v3_saved_by_us_loads_back_in_both(hf_zoo, tmp_path):
    """`save_checkpoint` writes DeepSeek-V3 with de-interleaved rotary dims
    (rope_interleave false) and kv_b_proj rebuilt from w_uk / w_uv: our loader reads
    the same params back, and transformers computes the same logits from it."""
    import torch

    cfg, params = load_model(hf_zoo["deepseek_v3"])
    save_checkpoint(tmp_path, cfg, params, dtype="float32")
    cfg2, params2 = load_model(tmp_path)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = hf_models.random_prompts((9,), cfg.vocab_size, seed=2)[0]
    ours = hf_models.load_torch_model(tmp_path)
    with torch.no_grad():
        want = hf_models.hf_logits(hf_zoo.torch_model("deepseek_v3"), prompt)
    np.testing.assert_allclose(hf_models.hf_logits(ours, prompt), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name",
    ["qwen3_5", *[pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3_next", "kimi_linear")]],
)
def test_hybrid_saved_by_us_loads_back_in_both(hf_zoo, tmp_path, name):
    """Qwen3.5 / Qwen3-Next as `save_checkpoint` writes them (zero-centred norms, the
    gated q_proj, the depthwise conv1d, Qwen3-Next's per-key-head fused projections
    rebuilt): our loader reads the same params and layer kinds back, and transformers
    computes the same logits from it."""
    import torch

    cfg, params = load_model(hf_zoo[name])
    assert cfg.is_hybrid
    if name != "kimi_linear":
        assert cfg.attn_output_gate and cfg.rotary_dim == 4
    else:
        v = hf_models.VARIANTS[name].config
        assert cfg.linear_kind == "kda" and cfg.is_mla and not cfg.use_rope
        assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim) == (4, 8)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.n_shared_experts,
                cfg.first_k_dense_replace) == (v["num_local_experts"], 2, 2, 1, 1)  # fmt: skip
    assert cfg.layer_types == tuple(hf_models.read_config(hf_zoo[name])["layer_types"])
    save_checkpoint(tmp_path, cfg, params, dtype="float32")
    cfg2, params2 = load_model(tmp_path)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    prompt = hf_models.random_prompts((9,), cfg.vocab_size, seed=2)[0]
    ours = hf_models.load_torch_model(tmp_path)
    with torch.no_grad():
        want = hf_models.hf_logits(hf_zoo.torch_model(name), prompt)
    np.testing.assert_allclose(hf_models.hf_logits(ours, prompt), want, atol=1e-4, rtol=0)


def test_load_config_accepts_config_json_path(hf_zoo):
    assert load_config(hf_zoo["qwen3"] / "config.json") == load_config(hf_zoo["qwen3"])


def _to_transformers4(hf: dict, rope_type_key: str = "rope_type") -> dict:
    """The same config in the keys transformers 4 wrote (and most hub checkpoints have)."""
    hf = dict(hf)
    rope = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":
        hf["rope_scaling"] = {rope_type_key: kind, **rope}
    if "num_local_experts" in hf:
        hf["num_experts"] = hf.pop("num_local_experts")
    hf["torch_dtype"] = hf.pop("dtype")
    return hf


@pytest.mark.parametrize(
    ("name", "rope_type_key"),
    [
        ("llama3_rope", "rope_type"),
        ("llama3_rope", "type"),  # the oldest spelling of rope_scaling
        ("qwen2", "rope_type"),
        ("qwen3_moe", "rope_type"),
        ("mistral_swa", "rope_type"),
    ],
)
def test_load_config_transformers4_keys(hf_zoo, tmp_path, name, rope_type_key):
    hf = hf_models.read_config(hf_zoo[name])
    hf_models.write_config(tmp_path, _to_transformers4(hf, rope_type_key))
    assert load_config(tmp_path) == load_config(hf_zoo[name])


def test_load_config_unsupported_architecture(hf_zoo, tmp_path):
    hf = hf_models.read_config(hf_zoo["llama"])
    hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    hf_models.write_config(tmp_path, hf)
    with pytest.raises(ValueError) as info:
        load_config(tmp_path)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED:
        assert arch in message


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_load_config_unsupported_rope_type(hf_zoo, tmp_path, spelling):
    hf = hf_models.read_config(hf_zoo["llama"])
    longrope = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64}
    if spelling == "rope_parameters":
        hf["rope_parameters"] = {**longrope, "rope_theta": 10000.0}
    else:
        hf = _to_transformers4(hf)
        hf["rope_scaling"] = longrope
    hf_models.write_config(tmp_path, hf)
    with pytest.raises(ValueError) as info:
        load_config(tmp_path)
    assert "longrope" in str(info.value)
    assert "llama3" in str(info.value) and "yarn" in str(info.value)


def test_load_config_missing_config_json(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        load_config(tmp_path)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("change", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}])
def test_load_config_rejects_moe_with_dense_layers(hf_zoo, tmp_path, change):
    """ModelConfig has no per-layer dense/sparse switch: such configs must not load."""
    hf = hf_models.read_config(hf_zoo["qwen3_moe"])
    hf_models.write_config(tmp_path, {**hf, **change})
    with pytest.raises(ValueError):
        load_config(tmp_path)


# ------------------------------------------------------------------------------ weights


def test_load_model_sharded_equals_unsharded(hf_zoo):
    assert len(_index(hf_zoo["llama_sharded"])["weight_map"]) > 0
    assert len(set(_index(hf_zoo["llama_sharded"])["weight_map"].values())) > 2
    cfg_a, params_a = load_model(hf_zoo["llama"])
    cfg_b, params_b = load_model(hf_zoo["llama_sharded"])
    assert cfg_a == cfg_b
    assert jax.tree.structure(params_a) == jax.tree.structure(params_b)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_model_bfloat16(hf_zoo):
    _, params32 = load_model(hf_zoo["qwen3_moe"], dtype="float32")
    _, params16 = load_model(hf_zoo["qwen3_moe"], dtype="bfloat16")
    leaves32, leaves16 = jax.tree.leaves(params32), jax.tree.leaves(params16)
    assert {leaf.dtype for leaf in leaves32} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in leaves16} == {jnp.dtype(jnp.bfloat16)}
    for a, b in zip(leaves32, leaves16, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_load_model_rejects_unknown_dtype(hf_zoo):
    with pytest.raises(ValueError, match="int8"):
        load_model(hf_zoo["llama"], dtype="int8")


def test_load_model_tied_checkpoint_with_redundant_lm_head(hf_zoo, tmp_path):
    """Some tied checkpoints still store lm_head.weight (a copy of the embedding)."""
    folder = _copy(hf_zoo["llama_tied"], tmp_path / "m")
    embed = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    _edit_safetensors(folder / "model.safetensors", put={"lm_head.weight": embed})
    _, params = load_model(folder)
    _, reference = load_model(hf_zoo["llama_tied"])
    assert jax.tree.structure(params) == jax.tree.structure(reference)


def test_load_model_missing_tensor(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["llama"], tmp_path / "m")
    _edit_safetensors(folder / "model.safetensors", drop=["model.layers.1.mlp.down_proj.weight"])
    assert "model.layers.1.mlp.down_proj.weight" in _load_error(folder)


def test_load_model_unexpected_tensor(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["llama"], tmp_path / "m")
    extra = {"model.layers.0.self_attn.extra_proj.weight": np.zeros((4, 4), np.float32)}
    _edit_safetensors(folder / "model.safetensors", put=extra)
    assert "model.layers.0.self_attn.extra_proj.weight" in _load_error(folder)


def test_load_model_shape_mismatch(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["llama"], tmp_path / "m")
    bad = {"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 64), np.float32)}
    _edit_safetensors(folder / "model.safetensors", put=bad)
    message = _load_error(folder)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert re.search(r"24,\s*64", message), message  # the shape found
    assert re.search(r"32,\s*64", message), message  # the shape expected (2 kv heads x 16)


def test_load_model_missing_shard_file(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["llama_sharded"], tmp_path / "m")
    shard = sorted(set(_index(folder)["weight_map"].values()))[1]
    (folder / shard).unlink()
    assert shard in _load_error(folder)


def test_load_model_stale_index_entry(hf_zoo, tmp_path):
    """A tensor the index lists but its (present) shard lacks; no shard file is missing."""
    folder = _copy(hf_zoo["llama_sharded"], tmp_path / "m")
    stale = "model.layers.1.post_attention_layernorm.weight"
    _edit_safetensors(folder / _index(folder)["weight_map"][stale], drop=[stale])
    message = _load_error(folder)
    assert stale in message
    assert "missing shard" not in message.lower(), message


def test_load_model_reports_every_defect_at_once(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["qwen3_moe"], tmp_path / "m")
    file = folder / "model.safetensors"
    dropped = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.gate.weight"]
    extra = "model.layers.1.mlp.shared_expert.up_proj.weight"
    reshaped = "model.layers.1.self_attn.q_norm.weight"
    _edit_safetensors(
        file,
        drop=dropped,
        put={extra: np.zeros((32, 48), np.float32), reshaped: np.ones((12,), np.float32)},
    )
    message = _load_error(folder)
    for name in [*dropped, extra, reshaped]:
        assert name in message, f"{name} missing from:\n{message}"
    assert re.search(r"\b12\b", message) and re.search(r"\b16\b", message), message


def test_load_model_sharded_reports_every_defect_at_once(hf_zoo, tmp_path):
    folder = _copy(hf_zoo["llama_sharded"], tmp_path / "m")
    index = _index(folder)
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    lost_shard = shards[0]
    # A tensor gone from its shard and from the index.
    gone = "model.layers.1.self_attn.o_proj.weight"
    gone_file = weight_map.pop(gone)
    assert gone_file != lost_shard
    _edit_safetensors(folder / gone_file, drop=[gone])
    # A tensor the index still lists but its shard no longer holds.
    stale = "model.layers.1.post_attention_layernorm.weight"
    assert weight_map[stale] != lost_shard
    _edit_safetensors(folder / weight_map[stale], drop=[stale])
    # An unexpected tensor and a misshapen one, both listed in the index.
    extra, reshaped = "model.layers.0.mlp.extra.weight", "model.norm.weight"
    host = weight_map[reshaped]
    assert host != lost_shard
    _edit_safetensors(
        folder / host,
        put={extra: np.zeros((3,), np.float32), reshaped: np.ones((65,), np.float32)},
    )
    weight_map[extra] = host
    _write_index(folder, index)
    (folder / lost_shard).unlink()

    message = _load_error(folder)
    for needle in (lost_shard, gone, stale, extra, reshaped, "65"):
        assert needle in message, f"{needle} missing from:\n{message}"


@pytest.mark.slow
def test_qwen3_5_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: its text model (under
    model.language_model., config in text_config) loads, the vision tower is left out,
    and the logits equal the wrapper's own on text-only input."""
    import torch
    import transformers

    text = {k: v for k, v in hf_models.VARIANTS["qwen3_5"].config.items()
            if k not in ("attn_implementation", "dtype")}  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    hf_models._reinit_(model)
    model.save_pretrained(tmp_path)
    cfg, params = load_model(tmp_path)
    assert cfg.architecture.value == "Qwen3_5ForCausalLM" and cfg.is_hybrid
    prompt = hf_models.random_prompts((11,), cfg.vocab_size, seed=4)[0]
    got = np.asarray(prefill_logits_one(params, cfg, prompt))
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def prefill_logits_one(params, cfg, prompt):
    from specdec.kernels.transformer import prefill_logits

    return prefill_logits(params, cfg, np.array([prompt]), np.array([len(prompt)]))[0]
