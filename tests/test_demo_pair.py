"""The bundled demo pair: shape and size budget, transformers parity, real speculation."""

import json
from pathlib import Path

import numpy as np
import pytest

from specdec.checkpoint import load_model
from specdec.kernels.transformer import prefill_logits

DEMO = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "demo"


def test_pair_budget():
    t_cfg, _ = load_model(DEMO / "target", dtype="bfloat16")
    d_cfg, _ = load_model(DEMO / "draft", dtype="bfloat16")
    assert t_cfg.architecture.value == "LlamaForCausalLM"
    assert t_cfg.num_params() >= 25_000_000  # float32 weights > 100 MB: memory-bound decode
    assert t_cfg.num_params() * 4 > 100e6
    assert d_cfg.num_params() * 20 <= t_cfg.num_params()

    def size(folder):
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    assert size(DEMO) - size(DEMO / "dflash") <= 60e6  # the pair
    assert size(DEMO / "dflash") <= 20e6  # the DFlash drafter (issue budget: 20 MB)
    for sub in ("target", "draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"):  # fmt: skip
            assert (DEMO / sub / name).is_file()
    assert json.loads((DEMO / "target" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (DEMO / "heldout_files.txt").is_file() and (DEMO / "README.md").is_file()


def test_transformers_loads_target_and_agrees():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(DEMO / "target")
    ids = tok("def fib(n):\n    if n < 2:\n        return n\n", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    cfg, params = load_model(DEMO / "target", dtype="float32")
    ours = np.asarray(prefill_logits(params, cfg, ids.numpy(), [ids.shape[1]]))[0]
    assert np.abs(ours - ref).max() <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_demo_pair_speculates_exactly():
    from specdec import LLM, SamplingParams

    prompt = "import os\n\n\ndef read_lines(path):\n"
    params = SamplingParams(temperature=0, max_tokens=48)
    ar = LLM(DEMO / "target", max_model_len=256, max_num_seqs=1)
    ref = ar.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = {"method": "draft_model", "model": str(DEMO / "draft"), "num_speculative_tokens": 16,
            "max_depth": 6, "topk": 4}  # fmt: skip
    llm = LLM(DEMO / "target", max_model_len=256, max_num_seqs=1, speculative_config=spec)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    assert llm.get_metrics()["acceptance_length"] > 1.5
