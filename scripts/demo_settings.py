"""The demo pair's training settings (scripts/train_demo_pair.py): model shapes,
per-stage optimisation, phase 3's self-distillation data, and the run's
`settings.json` (defaults, size rules, command-line overrides, resuming)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from demo_corpus import write_json  # scripts/demo_corpus.py, beside this file

from specdec.kernels.config import ModelConfig


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
class SelfDistillSettings:
    """Phase 3's data: the phase-2 target's own greedy continuations.

    At inference the draft follows the target's outputs, not the corpus, and a
    small target's greedy text (loops, half-remembered idioms) is far from the
    corpus. Each sequence is `prompt_len` corpus tokens (a seeded training
    window's start) then `length - prompt_len` tokens the target chose
    greedily, sequence i under `repetition_penalties[i % len(...)]` (1.0: plain
    greedy, the benchmarks; 1.2: `specdec generate`'s default). Generation also
    keeps the target's `teacher_topk` most likely next tokens (log-probabilities
    of its raw, unpenalised logits) at each generated position: the draft is then
    distilled without a teacher forward per step, which is ~85% of a corpus
    distillation step on CPU.
    """

    num_sequences: int
    prompt_len: int
    length: int  # prompt + generated tokens per sequence (a training row)
    repetition_penalties: tuple[float, ...]
    batch_size: int  # sequences generated at once (memory only: greedy is per row)
    teacher_topk: int
    # What the target computes in: its weights are always the bf16-rounded ones it
    # ships with; "float32" runs them as `dtype="auto"` does on a CPU without
    # bfloat16 arithmetic (the benchmarks' engine), "bfloat16" as stored.
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"self_distill.dtype must be bfloat16 or float32, got {self.dtype!r}.")


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
    # Phase 2: both models trained further, each from the bf16 rounding of its
    # phase-1 weights (what the phase-1 export ships), with fresh optimiser state.
    target_more: StageSettings
    draft_more: StageSettings
    kl_weight: float
    ce_weight: float  # draft: weight of the plain next-token cross-entropy
    eval_tokens: int  # held-out tokens scored for metrics (at most)
    eval_batch_size: int
    checkpoint_every_s: float
    log_every_s: float
    enforce_size_limits: bool  # the real pair's size rules (off for smoke runs)
    # generation_config.json's default for `specdec generate` and transformers: greedy
    # decoding of a model this small loops on one token; CTRL's 1.2 breaks the loops.
    repetition_penalty: float = 1.2
    # Phase 3 (absent from runs made before it existed): the draft distilled further
    # from the phase-2 target, on the target's own continuations.
    self_distill: SelfDistillSettings | None = None
    draft_final: StageSettings | None = None

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
        for k in ("target_train", "draft_train", "target_more", "draft_more", "draft_final"):
            if d.get(k) is not None:
                d[k] = StageSettings(**d[k])
        if d.get("self_distill") is not None:
            sd = dict(d["self_distill"])
            sd["repetition_penalties"] = tuple(sd["repetition_penalties"])
            d["self_distill"] = SelfDistillSettings(**sd)
        return cls(**d)

    def stage_settings(self, stage: str) -> StageSettings:
        """The optimisation settings of a training stage, by stage name."""
        field = {"target": "target_train", "draft": "draft_train"}.get(stage, stage)
        return getattr(self, field)

    @property
    def final_draft_stage(self) -> str:
        """The stage whose draft is exported: phase 3's when the run has one."""
        return "draft_final" if self.draft_final is not None else "draft_more"


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
            target_more=StageSettings(10, 4, 2e-3, 2, 0.1, 0.1, 1.0),
            draft_more=StageSettings(10, 4, 2e-3, 2, 0.1, 0.0, 1.0),
            kl_weight=1.0,
            ce_weight=0.1,
            eval_tokens=2048,
            eval_batch_size=8,
            checkpoint_every_s=5.0,
            log_every_s=2.0,
            enforce_size_limits=False,
            self_distill=SelfDistillSettings(16, 24, 49, (1.0, 1.2), 8, 16, "float32"),
            draft_final=StageSettings(10, 4, 2e-3, 2, 0.1, 0.0, 1.0),
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
        # Phase 2 (~70 + ~15 minutes): the phase-1 target (2.9M tokens seen) wrote
        # Python-like lines for some prompts but looped on `def fib(n):`.
        target_more=StageSettings(480, 8, 1e-3, 20, 0.1, 0.1, 1.0),
        draft_more=StageSettings(250, 8, 2e-3, 10, 0.1, 0.0, 1.0),
        kl_weight=1.0,
        ce_weight=0.1,
        eval_tokens=32768,
        eval_batch_size=8,
        checkpoint_every_s=300.0,
        log_every_s=60.0,
        enforce_size_limits=True,
        # Phase 3: 8192 continuations of 129 target tokens after 128 corpus tokens
        # (1.06M generated tokens), then 2000 steps of 16 of them (4 passes). Short
        # rows because generation here is bound by reading the cache. On 2 CPU
        # cores: 38 minutes generating, 19 training. The release before used half
        # of each (4096 sequences, 1000 steps) with the target computing in
        # bfloat16: 29 minutes generating, 8 training.
        self_distill=SelfDistillSettings(8192, 128, 257, (1.0, 1.2), 128, 32, "float32"),
        draft_final=StageSettings(2000, 16, 2e-3, 30, 0.1, 0.0, 1.0),
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
