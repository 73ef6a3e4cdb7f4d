"""Train the bundled demo pair: a small Llama target and a distilled Llama draft.

Both models speak Python: they are trained on the CPython standard library's own
source. Four stages, each resumable, all state in one run directory:

1. tokenizer: collect `*.py` under `sysconfig.get_paths()["stdlib"]` (tests,
   site-packages and generated blobs left out), hold out ~5% of the files by a
   seeded hash of their relative path, train a byte-level BPE on the rest and
   encode both parts into token streams. Each document is preceded by
   `<|endoftext|>`, the only special token (BOS and EOS).
2. target: next-token cross-entropy on packed windows, AdamW + warmup/cosine.
3. draft: distilled from the frozen target, loss = KL(target || draft) + a small
   cross-entropy, target logits computed on the fly.
4. export: Hugging Face folders (config.json, bf16 model.safetensors, tokenizer
   files, generation_config.json) and held-out metrics of the bf16 weights.

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
import hashlib
import io
import json
import math
import os
import platform
import signal
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specdec.kernels.config import ModelConfig
from specdec.kernels.transformer import forward_train as _forward_stacked
from specdec.kernels.transformer import init_params, unstack_layers

EOT = "<|endoftext|>"
EOT_ID = 0  # the first special token the BPE trainer sees gets id 0
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPORT_DIR = REPO_ROOT / "specdec" / "assets" / "demo"

# Folders never read: tests (and their data), installed packages.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Generated or machine-specific: pydoc_data/topics.py is 750 KB of docs in a
# string; _sysconfigdata_* and config-3.x-*/ describe this build of Python.
EXCLUDED_PREFIXES = ("pydoc_data/", "_sysconfigdata_", "config-")


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class ShapeSettings:
    """A Llama shape (the ModelConfig fields that the run chooses)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """Optimisation of one training stage (target or draft)."""

    steps: int
    batch_size: int  # packed windows per step
    peak_lr: float
    warmup_steps: int
    final_lr_fraction: float  # cosine decays to peak_lr * this
    weight_decay: float  # not applied to norms
    clip_norm: float

    def __post_init__(self):
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}."
            )


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything that determines the result; written to `settings.json`."""

    smoke: bool  # tiny models; exports default to RUN_DIR/export, never to the assets
    seed: int
    vocab_size: int
    heldout_per_mille: int  # files held out of tokenizer and model training
    max_files: int  # 0 = every file (smoke runs take a deterministic subset)
    seq_len: int  # tokens per packed training window
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    target: ShapeSettings
    draft: ShapeSettings
    target_train: StageSettings
    draft_train: StageSettings
    kl_weight: float
    ce_weight: float  # draft: weight of the plain next-token cross-entropy
    eval_tokens: int  # held-out tokens scored for metrics (at most)
    eval_batch_size: int
    checkpoint_every_s: float
    log_every_s: float
    enforce_size_limits: bool  # the real pair's size rules (off for smoke runs)

    def model_config(self, which: str) -> ModelConfig:
        shape = self.target if which == "target" else self.draft
        return ModelConfig(
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            **dataclasses.asdict(shape),
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunSettings:
        d = dict(d)
        d["target"] = ShapeSettings(**d["target"])
        d["draft"] = ShapeSettings(**d["draft"])
        d["target_train"] = StageSettings(**d["target_train"])
        d["draft_train"] = StageSettings(**d["draft_train"])
        return cls(**d)


def default_settings(smoke: bool) -> RunSettings:
    if smoke:
        tiny = ShapeSettings(64, 128, 2, 4, 2, 16)
        return RunSettings(
            smoke=True,
            seed=0,
            vocab_size=512,
            heldout_per_mille=50,
            max_files=60,
            seq_len=64,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            target=tiny,
            draft=ShapeSettings(32, 64, 1, 2, 1, 16),
            target_train=StageSettings(30, 4, 3e-3, 5, 0.1, 0.1, 1.0),
            draft_train=StageSettings(20, 4, 3e-3, 5, 0.1, 0.1, 1.0),
            kl_weight=1.0,
            ce_weight=0.1,
            eval_tokens=2048,
            eval_batch_size=8,
            checkpoint_every_s=5.0,
            log_every_s=2.0,
            enforce_size_limits=False,
        )
    return RunSettings(
        smoke=False,
        seed=0,
        vocab_size=4096,
        heldout_per_mille=50,
        max_files=0,
        seq_len=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        # 27.3M parameters: fp32 109 MB (> 100 MiB), bf16 54.5 MB.
        target=ShapeSettings(512, 1536, 8, 8, 4, 64),
        # 1.28M parameters (1/21 of the target), 2 layers so it can learn to copy.
        draft=ShapeSettings(192, 256, 2, 3, 1, 64),
        # Steps fit ~95 + ~35 minutes of this 2-core machine when it is otherwise
        # idle: a target step (8 x 512 tokens) measured 8.1 s, a draft step ~3.5 s.
        # (A first run with 4 x 420 target steps, 0.86M tokens, decoded repetitive
        # text: tokens seen matter more than anything else at this size.)
        target_train=StageSettings(700, 8, 1.5e-3, 40, 0.1, 0.1, 1.0),
        draft_train=StageSettings(600, 8, 3e-3, 30, 0.1, 0.0, 1.0),
        kl_weight=1.0,
        ce_weight=0.1,
        eval_tokens=32768,
        eval_batch_size=8,
        checkpoint_every_s=300.0,
        log_every_s=60.0,
        enforce_size_limits=True,
    )


def check_sizes(s: RunSettings) -> dict:
    """Parameter counts and the size rules of the bundled pair."""
    t, d = s.model_config("target").num_params(), s.model_config("draft").num_params()
    sizes = {
        "target_params": t,
        "draft_params": d,
        "target_fp32_bytes": 4 * t,
        "pair_bf16_bytes": 2 * (t + d),
        "draft_fraction": d / t,
    }
    if s.enforce_size_limits:
        if 4 * t <= 100 * 2**20:
            raise ValueError(f"target fp32 weights must exceed 100 MiB, got {4 * t} bytes.")
        if 2 * (t + d) > 60 * 10**6:
            raise ValueError(f"bf16 target + draft must be <= 60 MB, got {2 * (t + d)} bytes.")
        if d * 20 > t:
            raise ValueError(f"draft must have <= 1/20 of the target's params, got {d} vs {t}.")
    return sizes


def resolve_settings(run_dir: Path, args: argparse.Namespace) -> RunSettings:
    """Defaults + CLI overrides, or the run's stored settings when it already exists."""
    s = default_settings(args.smoke)
    if args.target_steps is not None:
        s = dataclasses.replace(
            s, target_train=dataclasses.replace(s.target_train, steps=args.target_steps)
        )
    if args.draft_steps is not None:
        s = dataclasses.replace(
            s, draft_train=dataclasses.replace(s.draft_train, steps=args.draft_steps)
        )
    path = run_dir / "settings.json"
    if not path.exists():
        write_json(path, s.to_json())
        return s
    stored = RunSettings.from_json(json.loads(path.read_text()))
    # Re-running without flags resumes; a flag that contradicts the run is an error.
    if args.smoke and not stored.smoke:
        raise ValueError(f"--smoke given but {path} holds a full run; use another run dir.")
    for flag, given, have in (
        ("target-steps", args.target_steps, stored.target_train.steps),
        ("draft-steps", args.draft_steps, stored.draft_train.steps),
    ):
        if given is not None and given != have:
            raise ValueError(f"--{flag} {given} contradicts {path} ({have}); use another run dir.")
    return stored


# ----------------------------------------------------------------------------- files


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def update_json(path: Path, updates: dict) -> None:
    d = json.loads(path.read_text()) if path.exists() else {}
    d.update(updates)
    write_json(path, d)


class Log:
    """Timestamped lines to stdout and `progress.log`, flushed at once."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


# ----------------------------------------------------------------------------- stage 1


def list_stdlib_files(stdlib: Path) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib `*.py` files used as the corpus."""
    out = []
    for p in stdlib.rglob("*.py"):
        rel = p.relative_to(stdlib).as_posix()
        if EXCLUDED_DIRS & set(rel.split("/")[:-1]) or rel.startswith(EXCLUDED_PREFIXES):
            continue
        out.append(rel)
    return sorted(out)


def is_heldout(rel: str, seed: int, per_mille: int) -> bool:
    digest = hashlib.sha256(f"specdec-heldout:{seed}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < per_mille


def read_corpus(s: RunSettings) -> tuple[Path, dict[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {}
    for rel in list_stdlib_files(stdlib):
        try:
            texts[rel] = (stdlib / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    if s.max_files:
        # A spread-out subset, the same every time.
        rels = sorted(texts)
        stride = max(1, len(rels) // s.max_files)
        texts = {r: texts[r] for r in rels[::stride][: s.max_files]}
    return stdlib, texts


def stage_tokenizer(run_dir: Path, s: RunSettings, log: Log) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    done = run_dir / "data" / "done.json"
    if done.exists():
        log("tokenizer: already done")
        return
    (run_dir / "data").mkdir(exist_ok=True)
    stdlib, texts = read_corpus(s)
    heldout = [r for r in texts if is_heldout(r, s.seed, s.heldout_per_mille)]
    train = [r for r in texts if r not in frozenset(heldout)]
    log(f"tokenizer: {len(train)} train files, {len(heldout)} held out, from {stdlib}")
    write_bytes_atomic(run_dir / "heldout_files.txt", "".join(r + "\n" for r in heldout).encode())

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=s.vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.time()
    tok.train_from_iterator((texts[r] for r in train), trainer=trainer, length=len(train))
    if tok.token_to_id(EOT) != EOT_ID or tok.get_vocab_size() != s.vocab_size:
        raise RuntimeError(
            f"tokenizer came out with {EOT} = {tok.token_to_id(EOT)} and "
            f"{tok.get_vocab_size()} tokens; expected {EOT_ID} and {s.vocab_size}."
        )
    # Like Llama, encoding a prompt prepends BOS: training windows see every
    # document start right after <|endoftext|>.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, EOT_ID)]
            ),
        ]
    )
    tok.save(str(run_dir / "tokenizer.json.tmp"))
    os.replace(run_dir / "tokenizer.json.tmp", run_dir / "tokenizer.json")
    log(f"tokenizer: trained {s.vocab_size} tokens in {time.time() - t0:.0f}s")

    stats = {}
    for name, rels in (("train", train), ("heldout", heldout)):
        encs = tok.encode_batch([texts[r] for r in rels], add_special_tokens=False)
        ids = np.concatenate([np.array([EOT_ID] + e.ids, np.uint16) for e in encs])
        buf = io.BytesIO()
        np.save(buf, ids)
        write_bytes_atomic(run_dir / "data" / f"{name}.npy", buf.getvalue())
        nbytes = sum(len(texts[r].encode()) for r in rels)
        stats[name] = {"files": len(rels), "tokens": int(ids.size), "bytes": nbytes}
        log(f"tokenizer: {name}: {ids.size} tokens, {nbytes / ids.size:.2f} bytes/token")
    corpus_hash = hashlib.sha256()
    for r in sorted(texts):
        corpus_hash.update(r.encode() + b"\0" + texts[r].encode() + b"\0")
    write_json(
        done,
        {
            "stdlib": str(stdlib),
            "python": platform.python_version(),
            "corpus_sha256": corpus_hash.hexdigest(),
            "tokenizer_sha256": hashlib.sha256(
                (run_dir / "tokenizer.json").read_bytes()
            ).hexdigest(),
            **stats,
        },
    )


def load_tokens(run_dir: Path, name: str) -> np.ndarray:
    return np.load(run_dir / "data" / f"{name}.npy").astype(np.int32)


# ----------------------------------------------------------------------------- data


class Windows:
    """Packed training windows in a seeded order; sample g is a pure function of g.

    Epoch e shifts the chunk grid by a random offset in [0, seq_len) and visits
    its chunks in a random permutation, both drawn from (seed, salt, e). A
    window is seq_len + 1 tokens: inputs are [:-1], labels [1:].
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, salt: int):
        if tokens.size < 2 * seq_len + 2:
            raise ValueError(f"need >= {2 * seq_len + 2} tokens, got {tokens.size}.")
        self.tokens, self.seq_len, self.seed, self.salt = tokens, seq_len, seed, salt
        self.per_epoch = (tokens.size - 1 - seq_len) // seq_len
        self._epoch, self._order, self._offset = -1, None, 0

    def sample(self, g: int) -> np.ndarray:  # i32[seq_len + 1]
        epoch, i = divmod(g, self.per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.salt, epoch])
            self._offset = int(rng.integers(self.seq_len))
            self._order = rng.permutation(self.per_epoch)
            self._epoch = epoch
        start = self._offset + int(self._order[i]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, first: int, size: int) -> np.ndarray:  # i32[size, seq_len + 1]
        return np.stack([self.sample(first + j) for j in range(size)])


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """The first held-out windows, non-overlapping: i32[n, seq_len + 1]."""
    n = min((tokens.size - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


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
        params, opt_state, meta = load_checkpoint_npz(ckpt, params, opt_state)
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


def stage_target(run_dir: Path, s: RunSettings, log: Log, stop: StopFlag):
    cfg = s.model_config("target")
    key = jax.random.key(s.seed)
    params = init_params(cfg, key)
    log(f"target: {cfg.num_params():,} parameters {dataclasses.asdict(s.target)}")
    windows = Windows(load_tokens(run_dir, "train"), s.seq_len, s.seed, salt=1)

    def loss_fn(params, x, y):
        return cross_entropy(forward_train(params, cfg, x), y)

    step_fn = make_train_step(loss_fn, make_optimizer(s.target_train))
    params = train_loop(
        name="target", run_dir=run_dir, s=s, st=s.target_train, params=params,
        step_fn=step_fn, extra_args=(), windows=windows,
        key_data=np.asarray(jax.random.key_data(key)), log=log, stop=stop,
    )  # fmt: skip
    metrics = run_dir / "metrics.json"
    if "target_fp32" not in (json.loads(metrics.read_text()) if metrics.exists() else {}):
        m = evaluate(run_dir, s, target=(cfg, params), draft=None)
        update_json(metrics, {"target_fp32": m["target"]})
        log(f"target: held-out (fp32 weights) {m['target']}")
    return params


def load_final(run_dir: Path, s: RunSettings, which: str):
    cfg = s.model_config(which)
    like = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    like = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), like)
    params, _, meta = load_checkpoint_npz(run_dir / f"{which}.ckpt.npz", like)
    if not meta["done"]:
        raise ValueError(f"{which} training is not finished (step {meta['step']}); run it first.")
    return cfg, params


def stage_draft(run_dir: Path, s: RunSettings, log: Log, stop: StopFlag):
    t_cfg, t_params = load_final(run_dir, s, "target")
    cfg = s.model_config("draft")
    key = jax.random.key(s.seed + 1)
    params = init_params(cfg, key)
    log(f"draft: {cfg.num_params():,} parameters {dataclasses.asdict(s.draft)}")
    windows = Windows(load_tokens(run_dir, "train"), s.seq_len, s.seed, salt=2)

    def loss_fn(params, t_params, x, y):
        t_logits = jax.lax.stop_gradient(forward_train(t_params, t_cfg, x))
        d_logits = forward_train(params, cfg, x)
        kl = kl_to_target(t_logits, d_logits)
        return s.kl_weight * kl + s.ce_weight * cross_entropy(d_logits, y)

    step_fn = make_train_step(loss_fn, make_optimizer(s.draft_train))
    params = train_loop(
        name="draft", run_dir=run_dir, s=s, st=s.draft_train, params=params,
        step_fn=step_fn, extra_args=(t_params,), windows=windows,
        key_data=np.asarray(jax.random.key_data(key)), log=log, stop=stop,
    )  # fmt: skip
    metrics = run_dir / "metrics.json"
    if "draft_fp32" not in (json.loads(metrics.read_text()) if metrics.exists() else {}):
        m = evaluate(run_dir, s, target=(t_cfg, t_params), draft=(cfg, params))
        update_json(metrics, {"draft_fp32": m["draft"]})
        log(f"draft: held-out (fp32 weights) {m['draft']}")
    return params


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


def hf_config(s: RunSettings, cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOT_ID,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def hf_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """Hugging Face names and [out, in] layout, float32 (the caller casts)."""
    lay = {k: np.asarray(v, np.float32) for k, v in params["layers"].items()}
    out = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32)}
    names = {
        "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }  # fmt: skip
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for ours, theirs in names.items():
            out[p + theirs + ".weight"] = np.ascontiguousarray(lay[ours][i].T)
        out[p + "input_layernorm.weight"] = lay["attn_norm"][i]
        out[p + "post_attention_layernorm.weight"] = lay["mlp_norm"][i]
    out["model.norm.weight"] = np.asarray(params["final_norm"], np.float32)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def write_hf_folder(out: Path, run_dir: Path, s: RunSettings, cfg: ModelConfig, params) -> None:
    from safetensors.flax import save_file

    out.mkdir(parents=True, exist_ok=True)
    try:
        from specdec.checkpoint import save_checkpoint
    except ImportError:
        save_checkpoint = None
    if save_checkpoint is not None:
        save_checkpoint(out, cfg, params, dtype="bfloat16")
        # It knows the shape, not the tokenizer: add ids and fields it may lack.
        written = json.loads((out / "config.json").read_text())
        for k, v in hf_config(s, cfg).items():
            if k in ("bos_token_id", "eos_token_id") or k not in written:
                written[k] = v
        write_json(out / "config.json", written)
    else:
        write_json(out / "config.json", hf_config(s, cfg))
        tensors = {k: jnp.asarray(v, jnp.bfloat16) for k, v in hf_tensors(cfg, params).items()}
        save_file(tensors, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
        os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
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
        {"_from_model_config": True, "bos_token_id": EOT_ID, "eos_token_id": EOT_ID},
    )


def bf16_round(params):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)


def stage_export(run_dir: Path, s: RunSettings, export_dir: Path, log: Log) -> None:
    t_cfg, t_params = load_final(run_dir, s, "target")
    d_cfg, d_params = load_final(run_dir, s, "draft")
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
        "--stage", choices=("all", "tokenizer", "target", "draft", "export"), default="all"
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
    run_stage = {
        "tokenizer": lambda: stage_tokenizer(run_dir, s, log),
        "target": lambda: stage_target(run_dir, s, log, stop),
        "draft": lambda: stage_draft(run_dir, s, log, stop),
        "export": lambda: stage_export(run_dir, s, export_dir, log),
    }
    for stage in run_stage if args.stage == "all" else (args.stage,):
        run_stage[stage]()
    log(f"finished stage {args.stage}")


if __name__ == "__main__":
    main()
