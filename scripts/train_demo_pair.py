"""Train the bundled demo pair: a small Llama target and a distilled Llama draft.

Both models speak Python: they are trained on the CPython standard library's own
source. Eight stages, each resumable, all state in one run directory:

1. tokenizer (scripts/demo_corpus.py): collect `*.py` under
   `sysconfig.get_paths()["stdlib"]` (tests, site-packages and generated blobs
   left out), hold out ~5% of the files by a seeded hash of their relative
   path, train a byte-level BPE on the rest and encode both parts into token
   streams. Each document is preceded by `<|endoftext|>`, the only special
   token (BOS and EOS).
2. target: next-token cross-entropy on packed windows, AdamW + warmup/cosine.
3. draft: distilled from the frozen target, loss = KL(target || draft) + a small
   cross-entropy, target logits computed on the fly.
4. target_more, 5. draft_more: phase 2, the same two trainings again (new data
   order, fresh optimiser, a second warmup/cosine), each starting from the bf16
   rounding of its phase-1 weights. The pair's first release was the phase-1
   export, so `--phase1-from specdec/assets/demo` can stand in for stages 2-3.
6. generate, 7. draft_final: phase 3 (scripts/demo_generate.py; sizes in
   `SelfDistillSettings`, scripts/demo_settings.py): the phase-2 target
   continues corpus windows greedily, recording its top-k next-token
   distribution at each generated token, and the draft is distilled further
   on those continuations (sparse KL to the recorded top-k + a small
   cross-entropy). `--phase2-from DIR`
   seeds stages 4-5 from an exported phase-2 pair so phase 3 runs alone. Runs
   whose settings predate phase 3 skip it.
8. export: Hugging Face folders (config.json, bf16 model.safetensors, tokenizer
   files, generation_config.json) and held-out metrics of the bf16 weights; the
   draft is phase 3's when the run has one, else phase 2's.

Reproducible: every setting lives in `settings.json` in the run directory and
seeds everything; the data order is a pure function of (seed, stage, epoch), so
a checkpoint's sample count is its whole data position. Resumable: checkpoints
(params + optax state + step + data position + init key) are written atomically
every few minutes and on SIGINT / SIGTERM; re-running the same command continues
from the last one.

    nohup setsid nice -n 19 python scripts/train_demo_pair.py \
        --run-dir /root/.cache/specdec_train > /root/.cache/specdec_train/train.log 2>&1 &
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from demo_corpus import (  # scripts/demo_corpus.py, beside this file
    EOT,
    EOT_ID,
    Log,
    Windows,
    eval_windows,
    fmt_time,
    load_tokens,
    stage_tokenizer,
    update_json,
    write_bytes_atomic,
    write_json,
)
from demo_generate import IndexRows, greedy_continuations, topk_kl  # beside this file
from demo_settings import RunSettings, StageSettings, check_sizes, resolve_settings

from specdec.kernels.config import ModelConfig
from specdec.kernels.transformer import forward_train as _forward_stacked
from specdec.kernels.transformer import init_params, unstack_layers

STAGES = ("tokenizer", "target", "draft", "target_more", "draft_more", "generate",
          "draft_final", "export")  # fmt: skip
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPORT_DIR = REPO_ROOT / "specdec" / "assets" / "demo"


# ----------------------------------------------------------------------------- losses


def forward_train(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The reference causal forward over per-layer weights (checkpoints stay stacked).

    XLA on CPU copies each scanned slice of stacked weights; unrolled static
    slices are cheap, which made a training step 17% faster here (4.7 -> 4.0 s).
    """
    return _forward_stacked(unstack_layers(params), cfg, tokens)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats). logits f32[B, T, V], labels i32[B, T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def kl_to_target(t_logits: jax.Array, d_logits: jax.Array) -> jax.Array:
    """Mean KL(target || draft) over positions. Both f32[B, T, V]."""
    log_p = jax.nn.log_softmax(t_logits, axis=-1)
    log_q = jax.nn.log_softmax(d_logits, axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1).mean()


def make_schedule(st: StageSettings) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=st.peak_lr,
        warmup_steps=st.warmup_steps,
        decay_steps=st.steps,
        end_value=st.peak_lr * st.final_lr_fraction,
    )


def make_optimizer(st: StageSettings) -> optax.GradientTransformation:
    schedule = make_schedule(st)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not path[-1].key.endswith("norm"), params
        )

    return optax.chain(
        optax.clip_by_global_norm(st.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=st.weight_decay, mask=decay_mask),
    )


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """(params, opt_state, *batch) -> (params, opt_state, loss, grad_norm), jitted."""

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(step, donate_argnums=(0, 1))


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint_npz(path: Path, params, opt_state, meta: dict) -> None:
    """params + optax state leaves and a JSON meta, replaced atomically."""
    arrays = {}
    for prefix, tree in (("params", params), ("opt", opt_state)):
        for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
            arrays[f"{prefix}/{i:04d}"] = np.asarray(leaf)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getvalue())


def load_checkpoint_npz(path: Path, params_like, opt_like=None):
    """Fills the templates' structures with the stored leaves. Returns (params, opt, meta)."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        out = []
        for prefix, tree in (("params", params_like), ("opt", opt_like)):
            if tree is None:
                out.append(None)
                continue
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            new = []
            for i, like in enumerate(leaves):
                a = z[f"{prefix}/{i:04d}"]
                if a.shape != np.shape(like):
                    raise ValueError(f"{path}: {prefix} leaf {i} is {a.shape}, want {like.shape}")
                new.append(jnp.asarray(a, dtype=jnp.asarray(like).dtype))
            out.append(jax.tree_util.tree_unflatten(treedef, new))
    return out[0], out[1], meta


class StopFlag:
    """Set by SIGINT / SIGTERM; the loop checkpoints and exits at the next step."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum, frame):
        self.signum = signum


# ----------------------------------------------------------------------------- stages 2, 3


def train_loop(
    *,
    name: str,
    run_dir: Path,
    s: RunSettings,
    st: StageSettings,
    params,
    step_fn: Callable,
    extra_args: tuple,
    windows: Windows,
    key_data: np.ndarray,
    log: Log,
    stop: StopFlag,
):
    """Runs (or resumes) one stage. Returns its final params."""
    ckpt = run_dir / f"{name}.ckpt.npz"
    optimizer = make_optimizer(st)
    opt_state = optimizer.init(params)
    step = 0
    if ckpt.exists():
        with np.load(ckpt) as z:
            done = json.loads(bytes(z["meta"]).decode())["done"]
        # A finished (or seeded) checkpoint needs no optimiser state.
        params, opt, meta = load_checkpoint_npz(ckpt, params, None if done else opt_state)
        opt_state = opt_state if done else opt
        step = meta["step"]
        if meta["data_position"] != step * st.batch_size:
            raise ValueError(f"{ckpt}: data position {meta['data_position']} != step * batch.")
        log(f"{name}: resumed from {ckpt} at step {step}/{st.steps}")
    if step >= st.steps:
        return params

    def save(step):
        meta = {
            "step": step,
            "total_steps": st.steps,
            "data_position": step * st.batch_size,  # samples consumed (Windows index)
            "init_key": key_data.tolist(),
            "done": step >= st.steps,
            "time": time.time(),
        }
        save_checkpoint_npz(ckpt, params, opt_state, meta)

    tokens_per_step = st.batch_size * s.seq_len
    t_start, timed_steps, timed_s, compiled = time.time(), 0, 0.0, False
    last_ckpt = last_log = time.time()
    losses, gnorms = [], []
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=st.steps, initial=step, desc=name, dynamic_ncols=True)
    while step < st.steps:
        t0 = time.time()
        batch = jnp.asarray(windows.batch(step * st.batch_size, st.batch_size))
        params, opt_state, loss, gnorm = step_fn(
            params, opt_state, *extra_args, batch[:, :-1], batch[:, 1:]
        )
        loss, gnorm = float(loss), float(gnorm)  # waits for the step
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name}: loss {loss} at step {step}; not checkpointing.")
        step += 1
        dt = time.time() - t0
        if compiled:  # the first step of a process includes compilation
            timed_steps, timed_s = timed_steps + 1, timed_s + dt
        compiled = True
        losses.append(loss)
        gnorms.append(gnorm)
        now = time.time()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if now - last_log >= s.log_every_s or step == st.steps or step == 1:
            per_step = timed_s / timed_steps if timed_steps else dt
            lr = float(make_schedule(st)(step - 1))  # the rate this step used
            log(
                f"{name} step {step}/{st.steps} loss {np.mean(losses):.4f} "
                f"gnorm {np.mean(gnorms):.3f} lr {lr:.2e} "
                f"tok/s {tokens_per_step / per_step:.0f} step_s {per_step:.2f} "
                f"elapsed {fmt_time(now - t_start)} eta {fmt_time(per_step * (st.steps - step))}"
            )
            losses, gnorms, last_log = [], [], now
        if now - last_ckpt >= s.checkpoint_every_s or step == st.steps or stop.signum:
            save(step)
            last_ckpt = time.time()
            if stop.signum:
                log(f"{name}: signal {stop.signum}, checkpointed at step {step}; exiting")
                sys.exit(128 + stop.signum)
    if bar is not None:
        bar.close()
    log(f"{name}: done, {st.steps} steps, checkpoint {ckpt}")
    return params


def _record_metrics(run_dir: Path, key: str, compute: Callable[[], dict], log: Log) -> None:
    metrics = run_dir / "metrics.json"
    if key not in (json.loads(metrics.read_text()) if metrics.exists() else {}):
        m = compute()
        update_json(metrics, {key: m})
        log(f"{key}: held-out {m}")


def _initial_params(run_dir: Path, s: RunSettings, which: str, key, start_from: str | None):
    """A seeded init (phase 1), or bf16(the finished `start_from` stage's weights)."""
    if start_from is not None:
        return bf16_round(load_final(run_dir, s, start_from)[1])
    return init_params(s.model_config(which), key)


def stage_target(run_dir: Path, s: RunSettings, log: Log, stop: StopFlag, *, more: bool):
    """Phase 1 (`target`): from a seeded init. Phase 2 (`target_more`): from bf16(phase 1)."""
    cfg = s.model_config("target")
    key = jax.random.key(s.seed if not more else s.seed + 2)
    params = _initial_params(run_dir, s, "target", key, "target" if more else None)
    name = "target_more" if more else "target"
    st = s.stage_settings(name)
    log(f"{name}: {cfg.num_params():,} parameters {dataclasses.asdict(s.target)}")
    windows = Windows(load_tokens(run_dir, "train"), s.seq_len, s.seed, salt=3 if more else 1)

    def loss_fn(params, x, y):
        return cross_entropy(forward_train(params, cfg, x), y)

    step_fn = make_train_step(loss_fn, make_optimizer(st))
    params = train_loop(
        name=name, run_dir=run_dir, s=s, st=st, params=params,
        step_fn=step_fn, extra_args=(), windows=windows,
        key_data=np.asarray(jax.random.key_data(key)), log=log, stop=stop,
    )  # fmt: skip
    _record_metrics(
        run_dir, f"{name}_fp32",
        lambda: evaluate(run_dir, s, target=(cfg, params), draft=None)["target"], log,
    )  # fmt: skip
    return params


def load_final(run_dir: Path, s: RunSettings, name: str):
    """(cfg, params) of a finished stage: target, draft, target_more or draft_more."""
    cfg = s.model_config("draft" if name.startswith("draft") else "target")
    like = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    like = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), like)
    params, _, meta = load_checkpoint_npz(run_dir / f"{name}.ckpt.npz", like)
    if not meta["done"]:
        raise ValueError(f"{name} training is not finished (step {meta['step']}); run it first.")
    return cfg, params


# Each draft stage: (its teacher's stage, the draft stage it starts from or None for a
# seeded init, init-key offset, data salt).
DRAFT_STAGES = {
    "draft": ("target", None, 1, 2),
    "draft_more": ("target_more", "draft", 3, 4),
    "draft_final": ("target_more", "draft_more", 4, 6),
}


def stage_draft(run_dir: Path, s: RunSettings, log: Log, stop: StopFlag, *, name: str):
    """Distils the draft from a frozen target: phases 1 and 2 on corpus windows with
    the target's logits computed on the fly, phase 3 (`draft_final`) on the target's
    own continuations and the top-k distributions it recorded while writing them."""
    teacher, start_from, key_offset, salt = DRAFT_STAGES[name]
    cfg = s.model_config("draft")
    key = jax.random.key(s.seed + key_offset)
    params = _initial_params(run_dir, s, "draft", key, start_from)
    st = s.stage_settings(name)
    log(f"{name}: {cfg.num_params():,} parameters {dataclasses.asdict(s.draft)}")
    t_cfg, t_params = load_final(run_dir, s, teacher)
    if name == "draft_final":
        windows, extra_args, loss_fn = _phase3_data(run_dir, s, cfg, salt, log)
    else:
        windows = Windows(load_tokens(run_dir, "train"), s.seq_len, s.seed, salt=salt)
        extra_args = (t_params,)

        def loss_fn(params, t_params, x, y):
            t_logits = jax.lax.stop_gradient(forward_train(t_params, t_cfg, x))
            d_logits = forward_train(params, cfg, x)
            kl = kl_to_target(t_logits, d_logits)
            return s.kl_weight * kl + s.ce_weight * cross_entropy(d_logits, y)

    step_fn = make_train_step(loss_fn, make_optimizer(st))
    params = train_loop(
        name=name, run_dir=run_dir, s=s, st=st, params=params,
        step_fn=step_fn, extra_args=extra_args, windows=windows,
        key_data=np.asarray(jax.random.key_data(key)), log=log, stop=stop,
    )  # fmt: skip
    if name == "draft_final":  # scored against the target as shipped (bf16 weights)
        t_params = bf16_round(t_params)
    _record_metrics(
        run_dir, f"{name}_fp32",
        lambda: evaluate(run_dir, s, target=(t_cfg, t_params), draft=(cfg, params))["draft"],
        log,
    )  # fmt: skip
    return params


def _phase3_data(run_dir: Path, s: RunSettings, cfg: ModelConfig, salt: int, log: Log):
    path = run_dir / "data" / "generated.npz"
    if not path.exists():
        raise ValueError(f"{path} is missing: run the generate stage first.")
    with np.load(path) as z:
        tokens = z["tokens"].astype(np.int32)
        top_logp = jnp.asarray(z["top_logp"].astype(np.float32))  # [n, G, k]
        top_ids = jnp.asarray(z["top_ids"].astype(np.int32))
    p = s.self_distill.prompt_len
    log(f"draft_final: {len(tokens)} generated sequences, teacher top-{top_ids.shape[-1]}")

    def loss_fn(params, top_logp, top_ids, x, y):
        # The batch's last column is each row's index (`IndexRows`): x ends with the
        # row's last token and the index, y with the index only; drop both.
        idx = y[:, -1]
        x, y = x[:, :-1], y[:, :-1]
        d_logp = jax.nn.log_softmax(forward_train(params, cfg, x)[:, p - 1 :], axis=-1)
        kl = topk_kl(top_logp[idx], top_ids[idx], d_logp)
        ce = -jnp.take_along_axis(d_logp, y[:, p - 1 :, None], axis=-1).mean()
        return s.kl_weight * kl + s.ce_weight * ce

    return IndexRows(tokens, s.seed, salt + 1), (top_logp, top_ids), loss_fn


def stage_generate(run_dir: Path, s: RunSettings, log: Log, stop: StopFlag) -> None:
    """Phase 3's data: the phase-2 target (bf16 weights, as shipped, computing in
    `self_distill.dtype`) continues seeded corpus windows greedily.
    `data/generated.npz`: tokens u16[n, length] and the teacher's top-k per
    generated token (`SelfDistillSettings`)."""
    out = run_dir / "data" / "generated.npz"
    if out.exists():
        log("generate: already done")
        return
    sd = s.self_distill
    t_cfg, t_params = load_final(run_dir, s, "target_more")
    params = unstack_layers(
        jax.tree_util.tree_map(lambda a: a.astype(sd.dtype), bf16_round(t_params))
    )
    windows = Windows(load_tokens(run_dir, "train"), s.seq_len, s.seed, salt=5)
    gen_len = sd.length - sd.prompt_len
    pens = np.array(sd.repetition_penalties, np.float32)
    parts, t0 = [], time.time()
    for first in range(0, sd.num_sequences, sd.batch_size):
        if stop.signum:  # nothing partial is kept: the stage starts over when rerun
            log(f"generate: signal {stop.signum} after {first} sequences; exiting")
            sys.exit(128 + stop.signum)
        n = min(sd.batch_size, sd.num_sequences - first)
        prompts = windows.batch(first, sd.batch_size)[:, : sd.prompt_len]  # fixed shape
        penalty = pens[np.arange(first, first + sd.batch_size) % len(pens)]
        toks, logp, ids = greedy_continuations(
            params, jnp.asarray(prompts), jnp.asarray(penalty), cfg=t_cfg, gen_len=gen_len,
            topk=sd.teacher_topk,
        )  # fmt: skip
        parts.append((np.concatenate([prompts, np.asarray(toks)], axis=1)[:n],
                      np.asarray(logp)[:n], np.asarray(ids)[:n]))  # fmt: skip
        elapsed, done = time.time() - t0, first + n
        eta = elapsed / done * (sd.num_sequences - done)
        log(f"generate: {done}/{sd.num_sequences} sequences of {gen_len} tokens, "
            f"{fmt_time(elapsed)} (eta {fmt_time(eta)})")  # fmt: skip
    tokens = np.concatenate([p[0] for p in parts]).astype(np.uint16)
    buf = io.BytesIO()
    np.savez(
        buf,
        tokens=tokens,
        top_logp=np.concatenate([p[1] for p in parts]).astype(np.float16),
        top_ids=np.concatenate([p[2] for p in parts]).astype(np.uint16),
    )
    write_bytes_atomic(out, buf.getvalue())
    distinct = {}  # how repetitive each kind is: distinct 4-grams per generated 4-gram
    for pen in sd.repetition_penalties:
        sel = tokens[pens[np.arange(len(tokens)) % len(pens)] == pen, sd.prompt_len :]
        grams = [len({tuple(r[i : i + 4]) for i in range(len(r) - 3)}) / (len(r) - 3) for r in sel]
        distinct[str(pen)] = float(np.mean(grams))
    update_json(run_dir / "metrics.json", {"generated": {
        "sequences": int(len(tokens)), "generated_tokens": int(len(tokens) * gen_len),
        "distinct_4gram_fraction_by_penalty": distinct, "seconds": time.time() - t0,
    }})  # fmt: skip
    log(f"generate: wrote {out} ({tokens.shape}); distinct 4-gram fraction {distinct}")


def seed_from_export(run_dir: Path, s: RunSettings, folder: Path, log: Log, phase: int) -> None:
    """Writes finished checkpoints of phase 1 or 2 from an exported pair (its bf16
    weights are exactly what the next phase starts from), so later phases can run
    without re-running the earlier ones."""
    from specdec.checkpoint import load_model

    stages = {1: ("target", "draft"), 2: ("target_more", "draft_more")}[phase]
    for which, stage in zip(("target", "draft"), stages, strict=True):
        ckpt = run_dir / f"{stage}.ckpt.npz"
        if ckpt.exists():
            log(f"{stage}: {ckpt} exists; not seeding it from {folder}")
            continue
        cfg, params = load_model(folder / which, dtype="float32")
        want = s.model_config(which)
        if cfg.num_params() != want.num_params() or cfg.num_layers != want.num_layers:
            raise ValueError(f"{folder / which} is not this run's {which} shape ({want}).")
        like = jax.eval_shape(lambda c=want: init_params(c, jax.random.key(0)))
        if jax.tree_util.tree_structure(like) != jax.tree_util.tree_structure(params):
            raise ValueError(f"{folder / which}: parameter tree differs from init_params'.")
        st = s.stage_settings(stage)
        meta = {
            "step": st.steps,
            "total_steps": st.steps,
            "done": True,
            "time": time.time(),
            "data_position": st.steps * st.batch_size,
            "seeded_from": str(folder / which),
        }
        save_checkpoint_npz(ckpt, params, (), meta)
        log(f"{stage}: checkpoint seeded from {folder / which}")


# ----------------------------------------------------------------------------- evaluation


def evaluate(run_dir: Path, s: RunSettings, *, target, draft) -> dict:
    """Held-out metrics per token (nats): cross-entropy, top-1 accuracy; for the
    draft also KL(target || draft) and top-1 agreement with the target (argmax,
    ties to the lowest id), which is the greedy chain acceptance rate."""
    w = eval_windows(load_tokens(run_dir, "heldout"), s.seq_len, s.eval_tokens)
    t_cfg, t_params = target

    @jax.jit
    def score(t_params, d_params, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        out = {}
        t_logits = forward_train(t_params, t_cfg, x)
        t_top = jnp.argmax(t_logits, axis=-1)
        out["t_ce"] = optax.softmax_cross_entropy_with_integer_labels(t_logits, y).sum()
        out["t_acc"] = (t_top == y).sum()
        if d_params is not None:
            d_logits = forward_train(d_params, draft[0], x)
            out["d_ce"] = optax.softmax_cross_entropy_with_integer_labels(d_logits, y).sum()
            out["d_acc"] = (jnp.argmax(d_logits, axis=-1) == y).sum()
            out["d_agree"] = (jnp.argmax(d_logits, axis=-1) == t_top).sum()
            out["d_kl"] = kl_to_target(t_logits, d_logits) * y.size
        return out

    totals: dict[str, float] = {}
    d_params = None if draft is None else draft[1]
    for i in range(0, len(w), s.eval_batch_size):
        for k, v in score(t_params, d_params, jnp.asarray(w[i : i + s.eval_batch_size])).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    n = w.shape[0] * s.seq_len
    res = {"target": {"loss": totals["t_ce"] / n, "top1_accuracy": totals["t_acc"] / n}}
    res["target"]["heldout_tokens"] = n
    if draft is not None:
        res["draft"] = {
            "loss": totals["d_ce"] / n,
            "top1_accuracy": totals["d_acc"] / n,
            "kl_from_target": totals["d_kl"] / n,
            "top1_agreement_with_target": totals["d_agree"] / n,
            "heldout_tokens": n,
        }
    return res


# ----------------------------------------------------------------------------- stage 4


# config.json fields transformers' LlamaConfig writes that `config_to_hf` leaves out.
HF_CONFIG_EXTRA = {
    "initializer_range": 0.02,
    "rope_scaling": None,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_cache": True,
    "bos_token_id": EOT_ID,
    "eos_token_id": EOT_ID,
}


def write_hf_folder(out: Path, run_dir: Path, s: RunSettings, cfg: ModelConfig, params) -> None:
    from specdec.checkpoint import save_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, cfg, params, dtype="bfloat16", **HF_CONFIG_EXTRA)
    write_bytes_atomic(out / "tokenizer.json", (run_dir / "tokenizer.json").read_bytes())
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOT,
            "eos_token": EOT,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": cfg.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                str(EOT_ID): {
                    "content": EOT,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
            },
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": EOT_ID,
            "eos_token_id": EOT_ID,
            "do_sample": False,
            "repetition_penalty": s.repetition_penalty,
        },
    )


def bf16_round(params):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)


def stage_export(run_dir: Path, s: RunSettings, export_dir: Path, log: Log) -> None:
    t_cfg, t_params = load_final(run_dir, s, "target_more")
    d_cfg, d_params = load_final(run_dir, s, s.final_draft_stage)
    for name, cfg, params in (("target", t_cfg, t_params), ("draft", d_cfg, d_params)):
        write_hf_folder(export_dir / name, run_dir, s, cfg, params)
        size = (export_dir / name / "model.safetensors").stat().st_size
        log(f"export: {export_dir / name} ({size / 1e6:.1f} MB safetensors)")
    m = evaluate(
        run_dir, s, target=(t_cfg, bf16_round(t_params)), draft=(d_cfg, bf16_round(d_params))
    )
    update_json(
        run_dir / "metrics.json",
        {"target_bf16": m["target"], "draft_bf16": m["draft"], "export_dir": str(export_dir)},
    )
    # Beside the pair: the files never trained on (benchmark prompts) and the figures.
    write_bytes_atomic(
        export_dir / "heldout_files.txt", (run_dir / "heldout_files.txt").read_bytes()
    )
    write_json(export_dir / "training.json", {
        "settings": s.to_json(), **json.loads((run_dir / "metrics.json").read_text())
    })  # fmt: skip
    log(f"export: held-out (bf16 weights) {json.dumps(m)}")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="state, logs, checkpoints")
    p.add_argument(
        "--stage",
        choices=("all", *STAGES),
        default="all",
    )
    p.add_argument(
        "--phase1-from",
        type=Path,
        default=None,
        help="an exported pair to take the phase-1 weights from (an earlier release)",
    )
    p.add_argument(
        "--phase2-from",
        type=Path,
        default=None,
        help="an exported pair to take the phase-2 weights from (phase 3 then runs alone)",
    )
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny models, a few steps")
    p.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        help=f"default {DEFAULT_EXPORT_DIR} (smoke runs: RUN_DIR/export)",
    )
    p.add_argument("--platform", default="cpu", help="JAX platform to train on")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except (ValueError, FileNotFoundError) as e:  # bad settings or run dir: no traceback
        sys.exit(f"train_demo_pair.py: error: {e}")


def _main(argv: list[str] | None) -> None:
    args = parse_args(argv)
    jax.config.update("jax_platforms", args.platform)
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = Log(run_dir / "progress.log")
    s = resolve_settings(run_dir, args)
    sizes = check_sizes(s)
    log(
        f"run {run_dir}: stage {args.stage}, target {sizes['target_params']:,} params, "
        f"draft {sizes['draft_params']:,} params (1/{1 / sizes['draft_fraction']:.1f}), "
        f"bf16 pair {sizes['pair_bf16_bytes'] / 1e6:.1f} MB, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    update_json(run_dir / "metrics.json", {"sizes": sizes})
    export_dir = args.export_dir or (run_dir / "export" if s.smoke else DEFAULT_EXPORT_DIR)
    stop = StopFlag()
    for phase, folder in ((1, args.phase1_from), (2, args.phase2_from)):
        if folder is not None:
            seed_from_export(run_dir, s, folder.resolve(), log, phase)
    run_stage = {
        "tokenizer": lambda: stage_tokenizer(run_dir, s, log),
        "target": lambda: stage_target(run_dir, s, log, stop, more=False),
        "draft": lambda: stage_draft(run_dir, s, log, stop, name="draft"),
        "target_more": lambda: stage_target(run_dir, s, log, stop, more=True),
        "draft_more": lambda: stage_draft(run_dir, s, log, stop, name="draft_more"),
        "generate": lambda: stage_generate(run_dir, s, log, stop),
        "draft_final": lambda: stage_draft(run_dir, s, log, stop, name="draft_final"),
        "export": lambda: stage_export(run_dir, s, export_dir, log),
    }
    phase3 = ("generate", "draft_final")
    if args.stage in phase3 and s.draft_final is None:
        raise ValueError(f"{run_dir / 'settings.json'} has no phase 3; use a new run dir.")
    stages = STAGES if args.stage == "all" else (args.stage,)
    for stage in stages:
        if s.draft_final is not None or stage not in phase3:  # runs made before phase 3
            run_stage[stage]()
    log(f"finished stage {args.stage}")


if __name__ == "__main__":
    main()
