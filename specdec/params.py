"""User-facing configuration: how to sample (`SamplingParams`) and how to speculate
(`SpeculativeConfig`). Both are frozen and validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token (vLLM's names and defaults).

    temperature 0 is greedy decoding (ties break to the lowest token id). With
    speculation the output distribution is exactly the target's under every
    combination of these parameters.
    """

    temperature: float = 1.0  # 0 = greedy; otherwise logits are divided by it
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token); 0 = off
    # > 1 discourages tokens already in the prompt or output: their logit is divided
    # by it when positive, multiplied when negative (HF / vLLM); 1 = off
    repetition_penalty: float = 1.0
    max_tokens: int = 16  # output tokens at most (never exceeded, even inside an accepted run)
    stop: tuple[str, ...] | None = None  # stop strings; the text ends before the first found
    stop_token_ids: tuple[int, ...] | None = None  # token ids that end the output (kept in it)
    ignore_eos: bool = False  # keep generating past the model's EOS token
    seed: int | None = None  # same seed -> same tokens, in any run and any batch
    skip_special_tokens: bool = True  # leave special tokens out of `text`

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable) or a positive integer, got {self.top_k}.")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}."
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.stop is not None:
            for s in self.stop:
                if not isinstance(s, str):
                    raise ValueError(f"stop strings must be str, got {s!r}.")
                if not s:
                    raise ValueError("stop strings must be non-empty, got ''.")
        if self.stop_token_ids is not None:
            for t in self.stop_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


SpeculativeMethod = Literal["draft_model", "dflash", "ngram"]
METHODS = ("draft_model", "dflash", "ngram")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the drafter grows each step's token tree.

    Example: `SpeculativeConfig(method="draft_model", model="path/to/draft",
    num_speculative_tokens=16, max_depth=6, topk=4)` grows up to 16 tree nodes,
    at most 6 deep, expanding each chosen node into its 4 most likely children;
    `topk=1` gives a chain of `min(num_speculative_tokens, max_depth)` tokens.
    `method="dflash"` takes a DFlash drafter folder (the `dflash` package's
    format): one forward per step drafts a block, and the tree grows from its
    per-position candidates (max_depth at most the block size - 1).
    """

    method: SpeculativeMethod = "draft_model"
    model: str | None = None  # draft model / DFlash drafter folder
    num_speculative_tokens: int | Literal["auto"] = "auto"  # tree nodes per step
    max_depth: int = 6  # longest root-to-leaf path
    topk: int = 4  # children per expanded node (1 = chain)
    prompt_lookup_min: int = 2  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method='draft_model' needs model=<draft model folder>.")
        if self.method == "dflash" and not self.model:
            raise ValueError("method='dflash' needs model=<DFlash drafter folder>.")
        if self.method == "ngram" and self.model:
            raise ValueError(
                f"model={self.model!r} is a draft model folder, for method='draft_model'; "
                "method='ngram' drafts from the sequence itself and takes none."
            )
        n = self.num_speculative_tokens
        if n != "auto" and (not _is_int(n) or n < 1):
            raise ValueError(f"num_speculative_tokens must be 'auto' or >= 1, got {n!r}.")
        if not _is_int(self.max_depth) or self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth!r}.")
        if not _is_int(self.topk) or self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk!r}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(
                f"Unknown speculative_config keys {unknown}; allowed: {sorted(fields)}."
            )
        return cls(**d)


# generation_config.json keys that set sampling defaults, as vLLM reads them. The
# sampling-only ones count when the file says do_sample: true (as in transformers).
GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p")
GENERATION_CONFIG_ALWAYS = ("repetition_penalty",)


def generation_defaults(folder) -> dict:
    """SamplingParams fields a model folder's generation_config.json sets ({} if none).

    Example: {"do_sample": false, "repetition_penalty": 1.2} -> {"repetition_penalty":
    1.2}; {"do_sample": true, "temperature": 0.6, "top_p": 0.9} -> both fields.
    A value SamplingParams refuses is an error naming the file.
    """
    import json
    from pathlib import Path

    path = Path(folder) / "generation_config.json"
    try:
        gen = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    keys = GENERATION_CONFIG_ALWAYS + (GENERATION_CONFIG_SAMPLING if gen.get("do_sample") else ())
    out = {k: gen[k] for k in keys if gen.get(k) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int, default=None
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt (a single one is shared by all); None = `default`."""
    if params is None:
        return [default or SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(
            f"The lengths of prompts ({n}) and sampling_params ({len(params)}) must be the same."
        )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p)}.")
    return params
