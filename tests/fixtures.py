"""Tiny models written by our own `save_checkpoint`, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec.checkpoint import load_model, save_checkpoint
from specdec.kernels.config import ModelConfig
from specdec.kernels.transformer import init_params

EOS = "<|endoftext|>"
CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "héllo wörld 世界 🙂 stop here. The end.",
] * 4


def write_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Byte-level BPE trained on CORPUS; returns its vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": EOS, "model_max_length": 512})
    )
    eos_id = tok.token_to_id(EOS)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return tok.get_vocab_size()


def tiny_config(vocab_size: int = 320, **overrides) -> ModelConfig:
    kw = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    kw.update(overrides)
    return ModelConfig(**kw)


def write_model(folder: Path, cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> Path:
    """Random weights (embeddings scaled by `scale` for peakier distributions)."""
    params = init_params(cfg, jax.random.key(seed))
    params["embed"] = params["embed"] * scale
    save_checkpoint(folder, cfg, params, dtype="float32")
    return folder


def tiny_pair(root: Path, seed: int = 0, scale: float = 30.0) -> Path:
    """A tokenizer + tiny Llama folder at root (returns it)."""
    v = write_tokenizer(root)
    write_model(root, tiny_config(v), seed=seed, scale=scale)
    return root


def noisy_copy(src, dst, noise: float, seed: int = 1):
    """The model at `src` with Gaussian noise (noise x each tensor's std): a partly right draft."""
    shutil.copytree(src, dst)
    cfg, params = load_model(src)
    rng = np.random.default_rng(seed)

    def perturb(a):
        a = np.asarray(a)
        return a + noise * a.std() * rng.standard_normal(a.shape).astype(np.float32)

    save_checkpoint(dst, cfg, jax.tree.map(perturb, params), dtype="float32")
    return dst


def free_port() -> int:
    """A loopback TCP port nothing listens on (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
    """Stops a process started with start_new_session=True and everything it started
    (its process group; never `ray stop`, which would stop every Ray process here)."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
