"""`specdec aot`: the megakernel compiled by libtpu's real Mosaic compiler on a CPU host.

In-process: `get_topology_desc(platform="tpu")` works with JAX on its CPU backend
(conftest sets JAX_PLATFORMS=cpu), so no TPU is touched and no lock file is taken.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specdec.checkpoint import config_to_hf, load_config
from specdec.kernels import aot
from specdec.kernels.megakernel import tuning

pytest.importorskip("libtpu", reason="AOT compilation needs libtpu")

MIB = tuning.MIB


@pytest.mark.parametrize(
    "topology",
    [
        "tpu7x:2x2x1",
        pytest.param("v6e:2x2", marks=pytest.mark.slow),
        pytest.param("v5e:2x2", marks=pytest.mark.slow),
    ],
)
def test_demo_target_compiles(topology):
    rep = aot.compile_verify(
        aot.PRESETS["demo-target"], topology=topology, tree_nodes=64, context=4096,
        config_name="demo-target",
    )  # fmt: skip
    assert rep.compiled and rep.fits, rep.error
    chip = tuning.chip_for_topology(topology)
    assert rep.vmem_bytes + tuning.VMEM_HEADROOM <= chip.vmem_bytes
    # 4096 committed positions of K and V: 8 layers * 4 heads * 64 * 2 bytes * 2 = 8 KiB
    # per position.
    assert rep.kv_bytes == 4096 * 8 * 1024
    assert rep.steps_per_s == pytest.approx(chip.hbm_bytes_per_s / rep.read_bytes)


def test_qwen3_8b_compiles_for_tpu7x(capsys):
    argv = ["--config", "qwen3-8b", "--topology", "tpu7x:2x2x1", "--tree-nodes", "64",
            "--context", "4096", "--dtype", "bfloat16", "--acceptance-length", "4"]  # fmt: skip
    assert aot.main(argv) == 0
    out = capsys.readouterr().out
    print(out)  # the figures quoted in docs/megakernel.md
    assert "OK in" in out and "per TensorCore" in out and "PROJECTION" in out
    assert "not a measurement) at acceptance length 4" in out and "GiB per device" in out


@pytest.mark.parametrize("tp", [1, 8])
def test_block_drafter_features_compile_for_tpu7x(tp):
    """The kernel with `taps` (a DFlash drafter's layers: one more HBM output, a DMA of
    the residual after each tapped layer) passes Mosaic, whole and split 8 ways."""
    rep = aot.compile_verify(
        aot.PRESETS["qwen3-8b"], topology="tpu7x:2x2x1", tree_nodes=16, context=1024, tp=tp,
        taps=(1, 17, 33), config_name="qwen3-8b",
    )  # fmt: skip
    assert rep.compiled, rep.error


@pytest.mark.slow
def test_qwen3_8b_report_figures():
    rep = aot.compile_verify(
        aot.PRESETS["qwen3-8b"], topology="tpu7x:2x2x1", tree_nodes=64, context=4096
    )
    assert rep.compiled and rep.fits, rep.error
    assert rep.vmem_bytes <= 61 * MIB
    # ~8.2B bf16 params minus all but 80 embedding rows: 14.1 GiB of weights.
    assert 14.0 < rep.weight_bytes / 1024**3 < 14.2
    assert rep.kv_bytes == 36 * 8 * 128 * 2 * 2 * 4096
    assert rep.tokens_per_s == pytest.approx(4 * 7.37e12 / rep.read_bytes)


@pytest.mark.slow
def test_oversized_blocks_are_rejected_by_the_compiler(capsys):
    # 8192-column LM-head tiles of a 4096-wide model: 2 x 64 MiB of bf16 in VMEM.
    argv = ["--config", "qwen3-8b", "--topology", "tpu7x:2x2x1", "--vocab-cols", "8192"]
    assert aot.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert "RESOURCE_EXHAUSTED" in out and "vmem" in out.lower()
    assert "MiB over" in out


def test_demo_preset_is_the_bundled_target():
    folder = Path(__file__).parents[1] / "specdec" / "assets" / "demo" / "target"
    if not (folder / "config.json").is_file():
        pytest.skip("no bundled demo target")
    assert load_config(folder) == aot.PRESETS["demo-target"]


def test_json_report_and_config_path(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(aot.PRESETS["demo-target"])))
    argv = ["--config", str(tmp_path), "--topology", "v5e:2x2", "--context", "512", "--json"]
    assert aot.main(argv, load_config=load_config) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled"] and report["device_kind"] == "TPU v5 lite"
    assert report["block_sizes"]["vmem_limit_bytes"] == 128 * MIB - tuning.VMEM_HEADROOM


def test_bad_input_is_reported(capsys):
    assert aot.main(["--config", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err
    assert aot.main(["--config", "demo-target", "--topology", "v9z:2x2"]) == 2
    assert "Unknown TPU generation" in capsys.readouterr().err
    assert aot.main(["--config", "demo-target", "--proj-cols", "96"]) == 2
    assert "proj_cols" in capsys.readouterr().err


def test_cli_dispatches_aot_flags(capsys):
    """`specdec aot --config ...` reaches the aot parser (flags are not eaten by the CLI's)."""
    from specdec import cli

    assert cli.main(["aot", "--config", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err


@pytest.mark.parametrize("as_file", [False, True], ids=["folder", "config.json"])
def test_cli_reads_a_model_folder_or_its_config(capsys, as_file):
    """`specdec aot --config PATH` from the command line: a HF folder or its config.json
    (the bundled demo target) compiles like the preset of the same shape."""
    import json as _json

    from specdec import cli

    folder = Path(cli.__file__).parent / "assets" / "demo" / "target"
    path = folder / "config.json" if as_file else folder
    rc = cli.main(["aot", "--config", str(path), "--topology", "v5e:2x2", "--json",
                   "--tree-nodes", "8", "--context", "256"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _json.loads(out)["config"] == str(path)


def test_device_memory_check_refuses_before_compiling(capsys):
    """Weights + K/V beyond one device's HBM are refused with both numbers, before any
    compile: Llama-3.1-70B in bfloat16 (~131 GiB of weights) on one TPU7x TensorCore
    (96 GiB, half of a 192 GB chip)."""
    cfg = aot.PRESETS["llama-3.1-70b"]
    weights, kv = aot.resident_bytes(cfg, "bfloat16", batch=1, max_len=4224)
    assert 130 < weights / tuning.GIB < 133 and kv == 2 * 80 * 8 * 128 * 4224 * 2
    want = (
        r"llama-3.1-70b needs 13\d\.\d GiB on one device \(13\d\.\d GiB of bfloat16 "
        r"weights \+ 1\.\d GiB of K/V cache .*than the 96 GiB of HBM one tpu7x"
    )
    with pytest.raises(ValueError, match=want):
        aot.compile_verify(cfg, topology="tpu7x:2x2x1", tree_nodes=64, context=4096,
                           config_name="llama-3.1-70b")  # fmt: skip
    assert aot.main(["--config", "llama-3.1-70b", "--topology", "tpu7x:2x2x1"]) == 2
    assert "more than the 96 GiB of HBM" in capsys.readouterr().err
    # Split 8 ways, each device holds an eighth of the weights and of the K/V heads.
    w8, kv8 = aot.resident_bytes(cfg, "bfloat16", batch=1, max_len=4224, tp=8)
    assert abs(w8 - weights / 8) < 0.01 * weights / 8 and kv8 == kv // 8
    # The dense 32B preset (the seed's 27B size class) fits one TensorCore's HBM.
    w32, kv32 = aot.resident_bytes(aot.PRESETS["qwen3-32b"], "bfloat16", batch=1, max_len=4224)
    assert w32 + kv32 < tuning.CHIPS["tpu7x"].hbm_bytes_per_device


def test_engine_and_aot_choose_one_step():
    """The engine's verify (`kernel.verify` without block sizes, here traced on the CPU,
    which sizes for the default chip) and `specdec aot` for that chip pick block sizes
    and the VMEM limit through one function, from the same inputs: the program
    compiled ahead of time is the one the engine would run."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from specdec.kernels.megakernel import kernel
    from specdec.verify.batch import SamplingBatch
    from specdec.verify.tree import ChildSampling

    seen = []
    real = tuning.step_block_sizes

    def spy(cfg, chip, **kw):
        bs = real(cfg, chip, **kw)
        seen.append((cfg, chip, kw, bs))
        return bs

    cfg, nodes, context = aot.PRESETS["demo-target"], 8, 256
    topology = f"{tuning.DEFAULT_CHIP}:2x2x1"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "step_block_sizes", spy)
        rep = aot.compile_verify(cfg, topology=topology, tree_nodes=nodes, context=context)
        max_len = seen[0][2]["max_len"]
        sds = jax.ShapeDtypeStruct
        params = jax.tree.map(lambda s: sds(s, jnp.bfloat16), aot.transformer.param_shapes(cfg),
                              is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip
        cache_shape = (cfg.num_layers, 1, cfg.num_kv_heads, max_len, cfg.head_dim)
        cache = aot.transformer.KVCache(
            sds(cache_shape, jnp.bfloat16), sds(cache_shape, jnp.bfloat16)
        )
        i32 = jnp.int32
        topk = ChildSampling.DETERMINISTIC_TOPK
        jax.eval_shape(
            functools.partial(kernel.verify, cfg=cfg, child_sampling=topk, interpret=True),
            params, cache, sds((1,), i32), sds((1, nodes), i32), sds((1, nodes), i32), None,
            sds((1,), i32), sds((1,), i32), SamplingBatch.make_dummy(1),
            sds((1, nodes + 1), jnp.float32),
        )  # fmt: skip
    (aot_cfg, aot_chip, aot_kw, aot_bs), (eng_cfg, eng_chip, eng_kw, eng_bs) = seen
    assert (aot_cfg, aot_chip, aot_kw) == (eng_cfg, eng_chip, eng_kw)
    assert aot_bs == eng_bs and rep.block_sizes == dataclasses.asdict(eng_bs)
    assert (
        eng_bs.vmem_limit_bytes
        == rep.vmem_limit_bytes
        == eng_chip.vmem_bytes - tuning.VMEM_HEADROOM
    )


@pytest.mark.parametrize(
    "config,tp",
    [
        pytest.param("demo-target", 2, marks=pytest.mark.slow),
        pytest.param("qwen3-32b", 8, marks=pytest.mark.slow),
        pytest.param("llama-3.1-70b", 8, marks=pytest.mark.slow),
        pytest.param("qwen3.5-27b", 8, marks=pytest.mark.slow),  # gated DeltaNet hybrid
        pytest.param("qwen3-30b-a3b", 8, marks=pytest.mark.slow),  # routed experts
    ],
)
def test_tensor_parallel_megakernel_compiles_for_tpu7x(config, tp, capsys):
    """The n-device kernel (remote DMAs, semaphores, shard_map) through libtpu's Mosaic
    compiler: Llama-3.1-70B, which one TensorCore cannot hold, fits split 8 ways."""
    from specdec.kernels.megakernel import shard

    cfg = aot.PRESETS[config]
    rep = aot.compile_verify(cfg, topology="tpu7x:2x2x1", tree_nodes=64, context=4096, tp=tp,
                             config_name=config)  # fmt: skip
    assert rep.compiled and rep.fits, rep.error
    assert rep.tp == tp and rep.resident_bytes < rep.hbm_capacity_bytes
    run, _ = shard.split_config(cfg, tp)
    rows = tuning.block_rows(64, np.dtype("bfloat16"))
    assert rep.bytes_sent == shard.step_bytes_sent(run, rows, tp) > 0
    assert rep.collective_hops == 4 * cfg.num_layers + 1
    assert 0 < rep.steps_per_s_with_ici < rep.steps_per_s
    bf16 = np.dtype("bfloat16")
    experts = rep.experts_expected if cfg.is_moe else None
    one = aot.weight_read_bytes(cfg, bf16, rows, experts=experts) + aot.kv_read_bytes(
        cfg, bf16, batch=1, context=4096
    )
    assert one / tp <= rep.read_bytes <= 1.1 * one / tp  # each device reads ~1/n of it
    if config == "qwen3-32b":  # Little's law: enough weight bytes outstanding per device
        assert rep.weight_bytes_in_flight["mlp"] >= 16 * tuning.MIB
    assert aot.main(["--config", config, "--tp", str(tp)]) == 0
    out = capsys.readouterr().out
    assert f"devices:      {tp} of the topology" in out and "PROJECTION" in out


def test_tensor_parallel_bad_splits_are_refused(capsys):
    assert aot.main(["--config", "llama-3.1-70b", "--tp", "16"]) == 2
    assert "--tp 16 needs 16 devices; tpu7x:2x2x1 has 8" in capsys.readouterr().err
    assert aot.main(["--config", "demo-target", "--tp", "3"]) == 2
    assert "splits num_heads (8) 3 ways" in capsys.readouterr().err
    # 4 K/V heads of 64 repeated to 8: 64-column projection tiles, not whole 128-lane
    # vectors on TPU.
    assert aot.main(["--config", "demo-target", "--tp", "8"]) == 2
    assert "must be a multiple of 128" in capsys.readouterr().err


def test_moe_step_reads_the_routed_union(capsys):
    """A MoE preset's report: the expected union of routed experts (uniform routing) and
    the worst case, the weight bytes of each; a lone decode row reads k experts."""
    cfg = aot.PRESETS["qwen3-30b-a3b"]
    rep = aot.compile_verify(cfg, topology="tpu7x:2x2x1", tree_nodes=8, context=1024,
                             config_name="qwen3-30b-a3b")  # fmt: skip
    assert rep.compiled and rep.fits, rep.error
    assert 8 < rep.experts_expected < rep.experts_worst == 72
    assert rep.weight_bytes < rep.weight_bytes_worst
    bf16 = np.dtype("bfloat16")
    one_row = aot.weight_read_bytes(cfg, bf16, 16, experts=8.0)
    assert one_row < 0.15 * aot.weight_read_bytes(cfg, bf16, 16)  # 8 of 128 experts
    assert aot.main(["--config", "qwen3-30b-a3b", "--tree-nodes", "8", "--context", "1024"]) == 0
    assert "experts:      the step's 9 rows route to" in capsys.readouterr().out


@pytest.mark.slow
def test_deepseek_v3_compiles_split_16_ways(capsys):
    """DeepSeek-V3 (MLA, 256 routed experts, dense first layers) through libtpu's
    Mosaic on 16 TPU7x devices, the fewest its bfloat16 weights fit: 128 heads and 256
    experts split 16 ways, the latent path and cache on every device, and hidden 7168's
    all-reduce in 14 chunks of 512 columns (`collectives.chunking`)."""
    from specdec.kernels.megakernel import collectives, shard

    cfg = aot.PRESETS["deepseek-v3"]
    assert collectives.chunking(cfg.hidden_size, 16) == (512, 14)
    rep = aot.compile_verify(cfg, topology="tpu7x:2x2x2", tree_nodes=64, context=4096, tp=16,
                             config_name="deepseek-v3")  # fmt: skip
    assert rep.compiled and rep.fits, rep.error
    assert rep.resident_bytes < rep.hbm_capacity_bytes
    assert 200 < rep.experts_expected < rep.experts_worst == 256  # 65 rows x 8 > 256
    assert rep.weight_bytes < rep.weight_bytes_worst
    run, _ = shard.split_config(cfg, 16)
    bf16 = np.dtype("bfloat16")
    assert rep.bytes_sent == shard.step_bytes_sent(run, tuning.block_rows(64, bf16), 16)
    # The latent cache is whole on every device: (512 + 64) bf16 values per position
    # and layer, not divided by 16.
    assert aot.kv_read_bytes(cfg, bf16, batch=1, context=4096, tp=16) == 4096 * 61 * 576 * 2
    assert aot.main(["--config", "deepseek-v3", "--topology", "tpu7x:2x2x1", "--tp", "8"]) == 2
    assert "needs 158.2 GiB on each of 8 devices" in capsys.readouterr().err
