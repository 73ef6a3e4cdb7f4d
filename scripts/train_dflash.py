"""Train a DFlash block drafter for a target (by default the bundled demo target).

The drafter (specdec.draft.dflash) reads the target's hidden states after
`target_layer_ids` for the committed tokens and, from one forward over the
current token plus `block_size - 1` mask tokens, predicts the next
`block_size - 1` tokens at once. Training follows that shape:

- Data: the Python standard library's source, less the bundled pair's
  held-out files (`heldout_files.txt`, never trained on), encoded with the
  target's tokenizer; packed windows of `seq_len` tokens in a seeded order
  (scripts/demo_corpus.py's `Windows`).
- Each step runs the frozen target over the windows once (its features at the
  drafter's layers and its logits), then draws `anchors` block starts per window;
  block j sees the window's context rows before its anchor and its own rows. The
  loss at block row d (predicting the token d places after the anchor) is
  KL(target || draft) against the target's next-token distribution there plus a
  small cross-entropy to the corpus token, weighted by exp(-(d - 1) / decay):
  early rows decide whether later ones are ever verified.
- AdamW with warmup and cosine decay; checkpoints (params, optimiser, step) every
  few minutes and on SIGINT / SIGTERM; rerunning the same command resumes
  (scripts/train_demo_pair.py's loop). Every setting is in `settings.json` in the
  run directory.
- Export: the `dflash` package's folder format (config.json naming
  DFlashDraftModel, a `dflash_config` with block_size / mask_token_id /
  target_layer_ids; model.safetensors in bfloat16), with held-out metrics of the
  exported weights in `training.json`: per-row top-1 agreement with the target's
  greedy token and the mean greedy chain length it implies.

    nohup setsid nice -n 19 python scripts/train_dflash.py --run-dir /root/.cache/dflash \
        > /root/.cache/dflash.log 2>&1 &
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from demo_corpus import EOT, Log, Windows, eval_windows, read_corpus, write_json
from demo_settings import StageSettings
from safetensors.numpy import save_file
from train_demo_pair import StopFlag, make_optimizer, make_train_step, train_loop

from specdec.checkpoint import load_model
from specdec.draft import dflash
from specdec.kernels import transformer
from specdec.kernels.config import Architecture, ModelConfig
from specdec.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "specdec" / "assets" / "demo"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run depends on (written to settings.json; a resumed run reads it)."""

    target: str = str(DEMO / "target")
    seed: int = 0
    seq_len: int = 256
    anchors: int = 16  # blocks per window per step
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    num_layers: int = 1
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    # A draft vocabulary of the training corpus's most frequent tokens (the drafter's
    # head is then that many of the target's columns; 0 = the whole vocabulary).
    draft_vocab_size: int = 0
    kl_weight: float = 1.0
    ce_weight: float = 0.1
    decay: float = 4.0  # row d's loss weight: exp(-(d - 1) / decay)
    steps: int = 2000  # the bundled drafter's (its training.json)
    batch_size: int = 8  # windows per step
    peak_lr: float = 2e-3
    warmup_steps: int = 40
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    max_files: int = 0  # 0 = every training file (a smoke run takes a few)
    eval_tokens: int = 16384
    log_every_s: float = 60.0
    checkpoint_every_s: float = 300.0

    def stage(self) -> StageSettings:
        return StageSettings(
            steps=self.steps, batch_size=self.batch_size, peak_lr=self.peak_lr,
            warmup_steps=self.warmup_steps, final_lr_fraction=self.final_lr_fraction,
            weight_decay=self.weight_decay, clip_norm=self.clip_norm,
        )  # fmt: skip


SMOKE = dict(seq_len=64, anchors=4, block_size=4, target_layer_ids=(0, 1), num_heads=4,
             num_kv_heads=2, head_dim=8, intermediate_size=64, steps=6, batch_size=2,
             warmup_steps=1, max_files=4, eval_tokens=256, log_every_s=0.0,
             draft_vocab_size=256)  # fmt: skip


def drafter_config(s: Settings, t_cfg: ModelConfig, mask_token_id: int) -> dflash.DFlashConfig:
    model = ModelConfig(
        vocab_size=t_cfg.vocab_size, hidden_size=t_cfg.hidden_size,
        intermediate_size=s.intermediate_size, num_layers=s.num_layers, num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=t_cfg.rms_norm_eps,
        rope_theta=t_cfg.rope_theta, max_position_embeddings=t_cfg.max_position_embeddings,
        architecture=Architecture.QWEN3, qk_norm=True,
    )  # fmt: skip
    return dflash.DFlashConfig(model=model, target_layer_ids=tuple(s.target_layer_ids),
                               block_size=s.block_size, mask_token_id=mask_token_id)  # fmt: skip


def init_drafter(dcfg: dflash.DFlashConfig, key) -> dict:
    """Normal(0.02) matrices ([in, out], as `dflash.load` gives them), norms at one."""
    c = dcfg.model
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = {"wq": (d, c.num_heads * hd), "wk": (d, c.num_kv_heads * hd),
              "wv": (d, c.num_kv_heads * hd), "wo": (c.num_heads * hd, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}  # fmt: skip
    norms = {"attn_norm": d, "mlp_norm": d, "q_norm": hd, "k_norm": hd}
    keys = iter(jax.random.split(key, 1 + c.num_layers * len(shapes)))

    def normal(shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    layers = tuple(
        {k: normal(v) for k, v in shapes.items()} | {k: jnp.ones(n) for k, n in norms.items()}
        for _ in range(c.num_layers)
    )
    fc = normal((len(dcfg.target_layer_ids) * d, d))
    return {"layers": layers, "fc": fc, "hidden_norm": jnp.ones(d), "norm": jnp.ones(d)}


def block_batch(dcfg, params, t_cfg, t_params, x, anchors):
    """Draft and target log-probabilities at every block row: ([W*K, B-1, V] x 2) and
    the corpus labels i32[W*K, B-1], for windows x i32[W, T] and anchors i32[W, K]."""
    w, t = x.shape
    k = anchors.shape[1]
    b = dcfg.block_size
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (w, t))
    mask = transformer.causal_block_mask(jnp.full((w,), t, jnp.int32), t)
    zeros = jnp.zeros((w,), jnp.int32)
    t_logits, _, _, feats = transformer.block_logits_kv(
        t_params, None, x, positions, mask, zeros, zeros, cfg=t_cfg,
        taps=dcfg.target_layer_ids,
    )  # fmt: skip
    t_logits, feats = jax.lax.stop_gradient((t_logits, feats))
    ctx = dflash.context_rows(dcfg, params, feats)
    keys, values = dflash.context_kv(dcfg, params, ctx, positions)  # [L, W, T, K, hd]
    keys, values = (dflash.head_major(jnp.repeat(a, k, axis=1)) for a in (keys, values))
    a = anchors.reshape(-1)  # [W*K]
    rows = jnp.repeat(jnp.arange(w), k)
    valid = jnp.arange(t)[None] < a[:, None]  # context before the anchor
    block_tok = jnp.full((w * k, b), dcfg.mask_token_id, jnp.int32).at[:, 0].set(x[rows, a])
    emb = t_params["embed"][block_tok].astype(jnp.float32) * dcfg.input_embedding_scale
    block_pos = a[:, None] + jnp.arange(b, dtype=jnp.int32)[None]
    hidden = dflash.forward_kv(dcfg, params, keys, values, valid, emb, block_pos)
    d_logits = dflash.draft_logits(dcfg, transformer.head_logits(t_cfg, t_params, hidden[:, 1:]))
    ahead = a[:, None] + jnp.arange(1, b, dtype=jnp.int32)[None]  # [W*K, B-1] target positions
    labels = x[rows[:, None], ahead]
    teacher = t_logits[rows[:, None], ahead - 1]  # the target's distribution for that token
    return jax.nn.log_softmax(d_logits, -1), jax.nn.log_softmax(teacher, -1), labels


def draw_anchors(seed: int, x, k: int, t: int, b: int):
    """k block starts per window in [1, t - b], a pure function of (seed, the window)."""
    key = jax.random.fold_in(jax.random.key(seed), jnp.sum(x.astype(jnp.uint32)))
    return jax.random.randint(key, (x.shape[0], k), 1, t - b + 1)


def make_loss(s: Settings, dcfg, t_cfg):
    weights = jnp.exp(-jnp.arange(dcfg.block_size - 1) / s.decay)
    weights = weights / weights.sum()

    def loss_fn(params, t_params, x, y):
        del y  # the block's labels come from x itself (the tokens after each anchor)
        anchors = draw_anchors(s.seed, x, s.anchors, x.shape[1], dcfg.block_size)
        log_q, log_p, labels = block_batch(dcfg, params, t_cfg, t_params, x, anchors)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [W*K, B-1]
        ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
        per_row = (s.kl_weight * kl + s.ce_weight * ce).mean(axis=0)
        return jnp.sum(weights * per_row)

    return loss_fn


def evaluate(s: Settings, dcfg, params, t_cfg, t_params, tokens: np.ndarray, ids=None) -> dict:
    """Held-out: each block row's top-1 agreement with the target's greedy token given
    the true prefix, and the mean greedy chain it implies (accepted rows before the
    first miss, + 1 bonus token per step); with a draft vocabulary `ids`, the drafter
    picks among those tokens only, as it does in the engine."""
    windows = eval_windows(tokens, s.seq_len, s.eval_tokens)
    run = jax.jit(lambda p, x, a: block_batch(dcfg, p, t_cfg, t_params, x, a))
    hits = []
    for i in range(0, len(windows), s.batch_size):
        x = jnp.asarray(windows[i : i + s.batch_size, :-1])
        anchors = draw_anchors(s.seed + 1, x, s.anchors, x.shape[1], dcfg.block_size)
        log_q, log_p, _ = run(params, x, anchors)
        guess = jnp.argmax(log_q, -1) if ids is None else jnp.asarray(ids)[
            jnp.argmax(log_q[..., ids], -1)]  # fmt: skip
        hits.append(np.asarray(guess == jnp.argmax(log_p, -1)))
    hits = np.concatenate(hits)  # [rows, B-1]
    chain = np.cumprod(hits, axis=1).sum(axis=1)
    out = {"blocks": int(len(hits)), "row_top1": [round(float(v), 4) for v in hits.mean(0)],
           "greedy_chain_tokens_per_step": round(float(chain.mean()) + 1, 3)}  # fmt: skip
    if ids is not None:  # how much of the held-out text the draft vocabulary covers
        out["draft_vocab_coverage"] = round(float(np.isin(tokens, ids).mean()), 4)
    return out


def draft_vocab(tokens: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent token ids of `tokens` (ties: the lower id), ascending."""
    counts = np.bincount(tokens, minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))
    return np.sort(order[:size]).astype(np.int32)


def corpus_tokens(run_dir: Path, s: Settings, tok: Tokenizer, log: Log) -> dict[str, np.ndarray]:
    """The training and held-out token streams (cached in the run directory)."""
    out = {}
    heldout = set((DEMO / "heldout_files.txt").read_text().split())
    for name in ("train", "heldout"):
        path = run_dir / f"{name}_tokens.npy"
        if path.exists():
            out[name] = np.load(path)
    if len(out) == 2:
        return out
    _, texts = read_corpus(s)
    eot = tok.backend.token_to_id(EOT)
    streams = {"train": [], "heldout": []}
    for rel in sorted(texts):
        ids = tok.encode(texts[rel])
        streams["heldout" if rel in heldout else "train"].append([eot, *ids])
    for name, docs in streams.items():
        arr = np.asarray([t for d in docs for t in d], np.int32)
        if arr.size < 2 * s.seq_len + 2:  # a smoke run's few files may hold no held-out one
            arr = np.asarray([t for d in streams["train"] for t in d], np.int32)
        np.save(run_dir / f"{name}_tokens.npy", arr)
        out[name] = arr
        log(f"{name}: {len(docs)} files, {arr.size:,} tokens")
    return out


def export(folder: Path, dcfg: dflash.DFlashConfig, params: dict, num_target_layers: int,
           ids=None):  # fmt: skip
    """The `dflash` package's folder format, weights in bfloat16; a draft vocabulary
    `ids` as EAGLE-3 stores one (`draft_vocab_size`, int64 offsets `d2t`)."""
    c = dcfg.model
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "num_target_layers": num_target_layers,
        "dflash_config": {"block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
                          "target_layer_ids": list(dcfg.target_layer_ids)},
    }  # fmt: skip
    if ids is not None:
        config["draft_vocab_size"] = len(ids)
    write_json(folder / "config.json", config)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
             "k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
             "mlp_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
             "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}  # fmt: skip

    def put(a, transpose):
        a = np.asarray(a, np.float32)
        return np.ascontiguousarray(a.T if transpose else a).astype(ml_dtypes.bfloat16)

    tensors = {"fc.weight": put(params["fc"], True), "hidden_norm.weight": put(
        params["hidden_norm"], False), "norm.weight": put(params["norm"], False)}  # fmt: skip
    for i, lp in enumerate(params["layers"]):
        for k, v in lp.items():
            tensors[f"layers.{i}.{names[k]}.weight"] = put(v, v.ndim == 2)
    if ids is not None:
        tensors["d2t"] = dflash.draft_vocab_offsets(ids)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)


def bf16_round(params):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--export-dir", type=Path, default=DEMO / "dflash")
    p.add_argument("--smoke", action="store_true", help="tiny settings, a few steps")
    p.add_argument("--target", default=None, help="target folder (default: the bundled one)")
    p.add_argument("--steps", type=int, default=None, help="total steps (a resumed run may grow)")
    args = p.parse_args(argv)
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = run_dir / "settings.json"
    if saved.exists():
        fields = json.loads(saved.read_text())
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        s = Settings(**fields)
    else:
        s = Settings(**(SMOKE if args.smoke else {}))
        if args.target:
            s = dataclasses.replace(s, target=args.target)
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    write_json(saved, dataclasses.asdict(s))
    log = Log(run_dir / "progress.log")
    stop = StopFlag()
    t_cfg, t_params = load_model(s.target, dtype="float32")
    bad = [i for i in s.target_layer_ids if not 0 <= i < t_cfg.num_layers]
    if bad:
        raise SystemExit(f"target_layer_ids {bad} are outside the target's {t_cfg.num_layers}.")
    tok = Tokenizer.from_pretrained(s.target)
    dcfg = drafter_config(s, t_cfg, tok.backend.token_to_id(EOT))
    tokens = corpus_tokens(run_dir, s, tok, log)
    key = jax.random.key(s.seed)
    params = init_drafter(dcfg, key)
    n = sum(np.size(a) for a in jax.tree_util.tree_leaves(params))
    log(f"dflash: {n:,} parameters, {s.num_layers} layer(s), block {s.block_size}, "
        f"target layers {list(s.target_layer_ids)}")  # fmt: skip
    st = s.stage()
    step_fn = make_train_step(make_loss(s, dcfg, t_cfg), make_optimizer(st))
    windows = Windows(tokens["train"], s.seq_len, s.seed, salt=11)
    params = train_loop(
        name="dflash", run_dir=run_dir, s=s, st=st, params=params, step_fn=step_fn,
        extra_args=(t_params,), windows=windows,
        key_data=np.asarray(jax.random.key_data(key)), log=log, stop=stop,
    )  # fmt: skip
    shipped = bf16_round(params)
    ids = None
    if s.draft_vocab_size:
        ids = draft_vocab(tokens["train"], s.draft_vocab_size, t_cfg.vocab_size)
    metrics = evaluate(s, dcfg, shipped, t_cfg, t_params, tokens["heldout"], ids)
    log(f"held-out (bf16 weights): {metrics}")
    export(args.export_dir, dcfg, shipped, t_cfg.num_layers, ids)
    settings = dataclasses.asdict(s)
    if Path(s.target).resolve().is_relative_to(REPO_ROOT):  # no local paths in a release
        settings["target"] = str(Path(s.target).resolve().relative_to(REPO_ROOT))
    record = {"settings": settings, "parameters": n, "heldout": metrics}
    write_json(args.export_dir / "training.json", record)
    log(f"exported to {args.export_dir}")


if __name__ == "__main__":
    sys.exit(main())
