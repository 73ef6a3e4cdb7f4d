"""The target worker: its model and KV cache, and the fused verify step.

`ModelRunner` (kernels/runner.py) owns one model's params, KV cache and
per-slot committed lengths; the target worker and the model drafter each hold
one (composition: neither inherits from the other). `TargetWorker` adds the verify step: the tree
forward over `[root, node_0, ..., node_{N-1}]`, the target sampling
distribution and the acceptance rule, all in one jitted call, then the commit.

Slot bookkeeping (host side, numpy): `cache_lens[s]` committed tokens of slot s
have K/V in the cache; the root (last committed token) does not yet. A verify
step writes the root at `cache_lens[s]` and node i at `cache_lens[s] + 1 + i`;
the commit keeps the root plus the accepted path and advances `cache_lens[s]`
by `1 + num_accepted`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specdec.checkpoint import load_model
from specdec.draft import dflash
from specdec.draft.base import DraftBatch, Drafter
from specdec.draft.block import BlockDrafter
from specdec.draft.model import ModelDrafter
from specdec.draft.ngram import NgramDrafter
from specdec.kernels import dot_library, sharding, transformer
from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel.reference import decide, tree_block
from specdec.kernels.runner import ModelRunner, live_rows, row_bucket
from specdec.kernels.transformer import KVCache, Layout, Params
from specdec.params import SpeculativeConfig
from specdec.plan import Plan, make_plan, verify_widths
from specdec.verify.acceptance import Verdict, emitted_tokens
from specdec.verify.batch import SamplingBatch
from specdec.verify.sampling import sample_from_uniform
from specdec.verify.tree import ChildSampling

logger = logging.getLogger(__name__)


def _verify_step(
    params: Params,
    cache: KVCache,
    roots: jax.Array,  # i32[B]
    tokens: jax.Array,  # i32[B, N]
    parents: jax.Array,  # i32[B, N], < -1 = padding
    draft_probs: jax.Array | None,  # f32[B, N+1, V] q per node; None for top-k / n-gram trees
    slots: jax.Array,  # i32[B]: the cache slot of each row, or -1 (padding)
    cache_lens: jax.Array,  # i32[B]
    sampling: SamplingBatch,
    *,
    cfg: ModelConfig,
    child_sampling: ChildSampling,
    kv_len: int | None = None,
    layout: Layout = transformer.REFERENCE,
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, ...]:
    """The reference verify step (`megakernel.reference`: the same block, the same
    `decide`) in the runner's layout, with the cache only read.

    Returns emitted i32[B, N+1], num_accepted i32[B], accepted_nodes i32[B, N] and
    the block's K/V [L, B, N+1, K, hd]; `commit_path` then writes the kept part
    (XLA on CPU copies the whole cache when one program both reads it and
    updates it in place). With `taps`, also the block's features at those layers
    f32[B, N+1, n x D] (`transformer.block_logits_kv`), for a block drafter.

    `emitted[b]` holds the accepted tokens then the bonus token, then -1.
    """
    n = tokens.shape[1]
    block, positions, mask = tree_block(roots, tokens, parents, cache_lens)
    logits, ks, vs, *feats = transformer.block_logits_kv(
        params, cache, block, positions, mask, slots, cache_lens, cfg=cfg, kv_len=kv_len,
        layout=layout, taps=taps,
    )  # fmt: skip
    verdict = decide(
        logits, block, mask, tokens, parents, draft_probs, sampling, sampling.uniforms(n + 1),
        child_sampling,
    )  # fmt: skip
    emitted = jax.vmap(emitted_tokens)(tokens, verdict)
    return (emitted, verdict.num_accepted, verdict.accepted_nodes, ks, vs, *feats)


# One compiled copy per CPU dot library (`dot_library`); `verify_step` = XLA's default.
VERIFY_STEPS = dot_library.jit_each(
    _verify_step, static_argnames=("cfg", "child_sampling", "kv_len", "layout", "taps")
)
verify_step = VERIFY_STEPS["default"]


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_path(
    cache: KVCache,
    ks: jax.Array,  # [L, B, N+1, K, hd] verify block K/V, block 0 = root
    vs: jax.Array,
    slots: jax.Array,  # i32[B], -1 = inactive
    cache_lens: jax.Array,  # i32[B] committed tokens before the step
    accepted_nodes: jax.Array,  # i32[B, N], -1 padded
) -> KVCache:
    """Writes the root and the accepted path's K/V at cache_lens, cache_lens + 1, ...

    Example: accepted nodes [0, 2] -> block indices [0, 1, 3] (root, node 0, node 2).
    """
    root = jnp.zeros((accepted_nodes.shape[0], 1), accepted_nodes.dtype)  # N may be 0
    keep = jnp.concatenate([root, jnp.maximum(accepted_nodes + 1, 0)], axis=1)
    counts = 1 + jnp.sum(accepted_nodes >= 0, axis=1, dtype=jnp.int32)  # root + accepted
    return transformer.write_kv(cache, ks, vs, slots, cache_lens, keep, counts)


@functools.partial(jax.jit)
def sample_first(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """First output token per row from last-prompt-token logits f32[B, V] -> i32[B]."""
    p = sampling.probs(sampling.penalize(logits[:, None]))[:, 0]
    return jax.vmap(sample_from_uniform)(p, sampling.uniforms(1)[:, 0])


def on_host(tree: DraftBatch) -> bool:
    """Whether every array of `tree` is numpy: its size can be read without waiting
    for a drafter still computing it on the device."""
    probs = tree.draft_probs
    return all(isinstance(a, np.ndarray) for a in (tree.tokens, tree.parents)) and (
        probs is None or isinstance(probs, np.ndarray)
    )


def narrowest(tree: DraftBatch, active: np.ndarray) -> DraftBatch:
    """The same trees at the narrowest `verify_widths` width that holds every
    active row's nodes, so a step whose drafter found little to propose (an n-gram
    drafter without a match: no tree at all) costs what a smaller tree costs, not
    the full width. A handful of widths, each compiled once: nothing re-traces
    from step to step. Trees still on the device (an in-process model drafter's)
    are left as they are: reading their size would wait for the drafter. The
    verdict does not depend on the width: a node's uniforms are indexed by node
    (`verify.acceptance`) and drawn prefix-stable (`SamplingBatch.uniforms`).

    Example: width 8, active rows with 0 and 3 nodes -> width 4.
    """
    n = tree.tokens.shape[1]
    if n == 0 or not on_host(tree):
        return tree
    real = tree.parents[np.asarray(active, bool)] >= -1  # [rows, N]
    cols = np.flatnonzero(real.any(axis=0))
    need = int(cols[-1]) + 1 if cols.size else 0
    return truncate(tree, min(w for w in verify_widths(n) if w >= need))


class WidthChooser:
    """Which `verify_widths` width a step verifies host-side trees at, given what
    each width costs and how many of its nodes the target has been accepting.

    `narrowest` keeps every node; at 8 sequences that can cost more than it wins,
    since one row with a match keeps the whole batch at full width. This picks,
    among the widths no wider than `narrowest`'s, the one with the most expected
    tokens per unit of cost,

        (active rows + rate * nodes kept) / cost(width),

    where a width keeps each row's first `width` nodes (a prefix of a topological
    order is a tree: every kept node's parent is kept), `cost(width)` is the verify
    cost relative to a plain decode step (`cost(0) == 1`), and `rate` is the share
    of verified nodes the target accepted, learnt from the verdicts (exponential
    average, starting from `prior`). Steps that verify nothing pull `rate` back
    towards `prior`, so a drafter that was skipped gets tried again later.

    Everything here is a function of the costs and the verdicts so far, with no
    timing of its own: given the same plan (`Plan.width_cost`) a seeded run
    repeats its choices, and so its output.
    """

    def __init__(self, cost, *, prior: float = 0.5, learn: float = 0.1, relax: float = 0.02):
        self.cost = cost  # width -> verify cost relative to a plain decode step
        self.prior, self.learn, self.relax = prior, learn, relax
        self.rate = prior

    def choose(self, parents: np.ndarray, active: np.ndarray) -> int:
        """The width to verify trees `parents` i32[S, N] (already `narrowest`) at."""
        n = parents.shape[1]
        rows = np.asarray(active, bool)
        real = parents[rows] >= -1  # [rows, N]
        best, best_value, floor = 0, float(rows.sum()), 1.0
        for w in verify_widths(n)[1:]:
            floor = max(floor, self.cost(w))  # a wider block never costs less (noise aside)
            value = (rows.sum() + self.rate * real[:, :w].sum()) / floor
            if value > best_value:
                best, best_value = w, value
        return best

    def observe(self, verified: int, accepted: int) -> None:
        """One step's totals over its active rows: nodes verified, nodes accepted."""
        if verified > 0:
            self.rate += self.learn * (accepted / verified - self.rate)
        else:
            self.rate += self.relax * (self.prior - self.rate)


def truncate(tree: DraftBatch, width: int) -> DraftBatch:
    """Each host tree's first `width` nodes (their draft probs too): still trees,
    since a node's parent comes before it."""
    if width >= tree.tokens.shape[1]:
        return tree
    probs = tree.draft_probs
    return DraftBatch(
        tree.tokens[:, :width],
        tree.parents[:, :width],
        None if probs is None else probs[:, : width + 1],
        tree.child_sampling,
    )


KernelName = Literal["auto", "megakernel", "xla"]


def kv_pool(
    cfg: ModelConfig, draft_cfg: ModelConfig | None, dtype: str, *, budget: int | None,
    num_slots: int, max_len: int, kernel: str,
) -> tuple[int, int | None]:  # fmt: skip
    """(slots, blocks per paged cache) for KV caches of `budget` bytes in all (None =
    `blocks.default_budget`): the target's and the draft's paged caches get as many
    blocks each (a draft never holds more positions than the target), so a block
    costs both models' bytes per position.

    The megakernel's cache is one contiguous row of `max_len` per slot: there the
    budget bounds the slots instead (at least one), and the blocks are None.
    """
    from specdec.kernels import blocks, xla_layout

    cdtype = xla_layout.cache_dtype(jnp.dtype(dtype), paged=kernel != "megakernel")
    per_token = transformer.token_bytes(cfg, cdtype)
    if draft_cfg is not None:
        per_token += transformer.token_bytes(draft_cfg, cdtype)
    if budget is None:
        budget = blocks.default_budget()
    if budget is not None and cfg.is_hybrid:
        # A hybrid target's linear layers hold a fixed state per slot, allocated for
        # every slot up front: it takes at most half the budget (fewer slots if
        # needed), K/V blocks the rest.
        from specdec.kernels import linear_attention

        state = linear_attention.bytes_per_slot(cfg, jnp.float32)
        fit = max(1, (budget // 2) // state)
        if fit < num_slots:
            logger.info("KV budget holds the linear-attention state of %d slots "
                        "(max_num_seqs=%d)", fit, num_slots)  # fmt: skip
            num_slots = fit
        budget -= num_slots * state
    if kernel == "megakernel":
        if budget is None:
            return num_slots, None
        fit = max(1, budget // (per_token * max_len))
        if fit < num_slots:
            logger.info("KV budget holds %d megakernel slots of %d positions (max_num_seqs=%d)",
                        fit, max_len, num_slots)  # fmt: skip
        return min(num_slots, fit), None
    try:
        n = blocks.num_blocks_for(budget, per_token, num_slots=num_slots, max_len=max_len)
    except ValueError as e:
        if not cfg.is_hybrid:
            raise
        raise ValueError(f"After the linear-attention state of {num_slots} slots, {e}") from None
    return num_slots, n


def resolve_kernel(kernel: str, cfg: ModelConfig, num_devices: int = 1) -> str:
    """The verify backend `kernel` names: "auto" = the megakernel on TPU (over the
    target's devices, `megakernel.shard`), XLA elsewhere.

    "auto" takes XLA where the megakernel cannot split the model over
    `num_devices` (MoE, a dimension that does not divide); asking for the
    megakernel there is an error naming why, never a silent fallback.
    """
    from specdec.kernels.megakernel import shard

    if kernel not in VERIFY_BACKENDS and kernel != "auto":
        raise ValueError(f"kernel must be 'auto', 'megakernel' or 'xla', got {kernel!r}.")
    tpu = jax.default_backend() == "tpu"
    try:
        shard.check_shardable(cfg, num_devices, tpu=tpu)
    except ValueError as e:
        if kernel == "megakernel":
            raise ValueError(f"kernel='megakernel': {e}") from None
        return "xla"
    if kernel == "auto":
        return "megakernel" if tpu else "xla"
    return kernel


def _verify_xla(r: ModelRunner, roots, tree: DraftBatch, slots, active, sampling,
                library: str = "default"):  # fmt: skip
    """Jitted tree forward + acceptance, then one donated write of the kept K/V.

    Rows are the step's live rows (`runner.live_rows`): row b is slot slots[b]."""
    n = tree.tokens.shape[1]
    cache_lens = r.cache_lens[np.maximum(slots, 0)]  # a copy: jax never sees a buffer we mutate
    emitted, num, accepted, ks, vs, *feats = VERIFY_STEPS[library](
        r.params, r.cache, roots, tree.tokens, tree.parents, tree.draft_probs, slots,
        cache_lens, sampling, cfg=r.cfg, child_sampling=tree.child_sampling,
        kv_len=r.kv_len(active, int(r.cache_lens[active].max(initial=0)) + 2 + n),
        layout=r.layout.for_library(library), taps=r.taps,
    )  # fmt: skip
    r.cache = commit_path(r.cache, ks, vs, slots, cache_lens, accepted)
    return (emitted, num, accepted, *feats)


def _verify_megakernel(r: ModelRunner, roots, tree: DraftBatch, slots, active, sampling,
                       library: str = "default"):  # fmt: skip
    """The Pallas verify megakernel (interpret mode off TPU), then the K/V commit.

    `library` is ignored: the kernel's products are its own."""
    from specdec.kernels import megakernel

    n = tree.tokens.shape[1]
    cache_lens = r.cache_lens[np.maximum(slots, 0)]
    res = megakernel.verify(
        r.params, r.cache, roots, tree.tokens, tree.parents, tree.draft_probs, slots,
        cache_lens, sampling, sampling.uniforms(n + 1), cfg=r.cfg,
        child_sampling=tree.child_sampling, interpret=jax.default_backend() != "tpu",
        mesh=r.mesh, taps=r.taps,
    )  # fmt: skip
    verdict = Verdict(res.accepted_nodes, res.num_accepted, res.bonus)
    src = jnp.where(res.accepted_nodes >= 0, res.accepted_nodes + 1, 0)
    r.cache = transformer.commit_kv(res.cache, slots, cache_lens, src, res.num_accepted, res.lin)
    emitted = jax.vmap(emitted_tokens)(tree.tokens, verdict)
    feats = () if res.features is None else (res.features,)
    return (emitted, res.num_accepted, res.accepted_nodes, *feats)


# How the target verifies a tree: same inputs, same verdict (tests/test_megakernel.py).
VERIFY_BACKENDS = {"xla": _verify_xla, "megakernel": _verify_megakernel}


class TargetWorker:
    """The target model: prefill, then fused verify-and-commit steps."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        *,
        num_slots: int,
        max_model_len: int,
        max_tree_nodes: int = 0,
        prefill_chunk: int = 512,
        kernel: KernelName = "auto",
        plan: Plan | None = None,  # None = made here (`plan.make_plan`)
        mesh: Mesh | None = None,  # shard the target over it (tensor parallel); None = one
        num_blocks: int | None = None,  # paged KV pool (`blocks.num_blocks_for`); None = all
    ):
        self.cfg = cfg
        self.max_tree_nodes = max_tree_nodes
        if plan is None:
            dtype = jnp.dtype(params["embed"].dtype).name
            plan = make_plan(cfg, dtype=dtype, spec=None, num_slots=num_slots,
                             max_tree_nodes=max_tree_nodes)  # fmt: skip
        self.plan = plan
        n = 1 if mesh is None else mesh.size
        self.kernel = resolve_kernel(kernel, cfg, n)
        self._verify = VERIFY_BACKENDS[self.kernel]
        run_cfg = cfg
        if self.kernel == "megakernel":
            from specdec.kernels.megakernel import shard

            # Once, at load: the stacks a hybrid or mixed MoE model's kernel streams
            # (read back by `linear_attention.per_layer` / `stacks.per_layer`), MLA's
            # wkv_a padded to whole lanes, and over n devices K/V heads repeated up to n
            # and the vocabulary padded, so each device streams whole shards; the
            # runner's forwards see the same model.
            run_cfg, params = shard.prepare_params(cfg, params, n)
        self.runner = ModelRunner(
            run_cfg,
            params,
            num_slots=num_slots,
            max_len=max_model_len + max_tree_nodes + 1,
            prefill_chunk=prefill_chunk,
            stacked=self.kernel == "megakernel",  # the kernel streams [L, ...] weights
            # A lone request's plain decode step is one row, whatever the slot count.
            one_row=True,
            num_blocks=num_blocks,
        )
        if n > 1:
            sharding.shard_runner(self.runner, mesh)  # GSPMD partitions every other step
        # Host trees' verify width; None = always the narrowest that holds every node
        # (what a benchmark of the verify cost per tree size needs).
        self.widths: WidthChooser | None = WidthChooser(plan.width_cost)
        self.features: tuple[np.ndarray, jax.Array] | None = None  # the last verify's (`tap`)

    def tap(self, layers: tuple[int, ...]) -> None:
        """From now on prefill and verify keep the outputs of `layers` (a block drafter's
        `target_layers`): `runner.prefill_features` and `features`."""
        n = self.cfg.num_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"The drafter reads target layers {list(layers)}; {bad} are outside this "
                f"target's {n} layers (0 .. {n - 1})."
            )
        self.runner.taps = tuple(int(i) for i in layers)

    @property
    def cache_lens(self) -> np.ndarray:
        return self.runner.cache_lens

    def reserve(self, slots, lengths) -> None:
        """Rows will grow to about `lengths` tokens: verify reads that many positions."""
        self.runner.reserve(slots, lengths)

    def kv_capacity(self) -> tuple[int, int, int]:
        """(positions per KV block, blocks for sequences, positions per sequence):
        what the engine admits by (`ModelRunner.kv_capacity`)."""
        return self.runner.kv_capacity()

    def prefill(self, slots, prompts, sampling: SamplingBatch) -> np.ndarray:
        """Prefills prompts into slots; returns each row's first output token (root).

        The first tokens are drawn for `row_bucket` rows (the prompts', then greedy
        padding rows), so a handful of compiled draws serves any number of prompts."""
        b = len(prompts)
        rows = row_bucket(b, max(b, self.runner.num_slots))
        logits = self.runner.prefill(slots, prompts)
        logits = np.concatenate([logits, np.zeros((rows - b, logits.shape[1]), logits.dtype)])
        return np.asarray(sample_first(logits, sampling.padded(rows)))[:b]

    def verify(
        self,
        roots: np.ndarray,  # i32[S]
        tree: DraftBatch,
        active: np.ndarray,  # bool[S]
        sampling: SamplingBatch,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One verify + commit over the active slots (arrays are per slot, row s =
        slot s; the step itself runs over the live rows only, `live_rows`).

        Returns emitted i32[S, N+1] (accepted tokens, bonus, then -1),
        num_accepted i32[S] and accepted_nodes i32[S, N] (-1 padded); inactive
        slots get emitted -1, num_accepted 0.
        """
        r = self.runner
        active = np.asarray(active, bool)
        full = tree.tokens.shape[1]
        tree = narrowest(tree, active)
        host = self.widths is not None and on_host(tree)
        if host and tree.tokens.shape[1] > 0:
            tree = truncate(tree, self.widths.choose(tree.parents, active))
        n = tree.tokens.shape[1]
        slots = live_rows(active, r.num_slots)
        live = slots[slots >= 0]
        # The root and path land at cache_lens .. cache_lens + 1 + n.
        r.ensure(live, r.cache_lens[live] + n + 1)
        take = np.maximum(slots, 0)  # padding rows repeat slot 0's inputs; their output is dropped
        roots_r = np.asarray(roots)[take]
        sampling_r = sampling.rows(take)
        tree_r = tree.rows(take)
        library = self.plan.library(len(slots) * (n + 1))
        emitted_r, num_r, accepted_r, *feats = self._verify(
            r, roots_r, tree_r, slots, active, sampling_r, library
        )
        # The block's features per live row (row b = slot slots[b]; node i at i + 1),
        # for a block drafter's commit (`tap`).
        self.features = (slots, feats[0]) if feats else None
        s_count = r.num_slots
        emitted = np.full((s_count, n + 1), -1, np.int32)
        num = np.zeros(s_count, np.int32)
        accepted = np.full((s_count, n), -1, np.int32)
        k = len(live)
        emitted[live] = np.asarray(emitted_r)[:k]
        num[live] = np.asarray(num_r)[:k]
        accepted[live] = np.asarray(accepted_r)[:k]
        r.cache_lens[active] += 1 + num[active]
        if host:
            self.widths.observe(int((tree.parents[active] >= -1).sum()), int(num[active].sum()))
        if (pad := full - n) > 0:  # callers get the width they sent
            emitted = np.pad(emitted, ((0, 0), (0, pad)), constant_values=-1)
            accepted = np.pad(accepted, ((0, 0), (0, pad)), constant_values=-1)
        return emitted, num, accepted

    def release(self, slot: int) -> None:
        self.runner.release(slot)


# ----------------------------------------------------------------------------- drafters


def _vocab_limit(target_path, target_cfg: ModelConfig, draft_path, draft_cfg) -> int:
    """Token ids both models may exchange; refuses drafts with another vocabulary.

    Embedding tables may differ in trailing padding rows (ids no tokenizer
    produces); the tokenizers themselves must be identical.
    """
    from specdec.tokenizer import Tokenizer

    t_tok = Path(target_path, "tokenizer.json")
    d_tok = Path(draft_path, "tokenizer.json")
    vt, vd = target_cfg.vocab_size, draft_cfg.vocab_size
    if t_tok.is_file() and d_tok.is_file():
        tv = Tokenizer.from_pretrained(target_path).backend.get_vocab(with_added_tokens=True)
        dv = Tokenizer.from_pretrained(draft_path).backend.get_vocab(with_added_tokens=True)
        if tv != dv:
            raise ValueError(
                f"The draft's tokenizer differs from the target's (draft vocabulary "
                f"{len(dv)} tokens, target {len(tv)}); speculative decoding needs the same "
                "tokenizer."
            )
        if min(vt, vd) < len(tv):
            raise ValueError(
                f"Embedding rows (draft {vd}, target {vt}) must cover the tokenizer's "
                f"{len(tv)} tokens."
            )
        return min(vt, vd)
    if vt != vd:
        raise ValueError(
            f"The draft's vocabulary ({vd} tokens) differs from the target's ({vt}); "
            "without tokenizer.json files only equal sizes are accepted."
        )
    return vt


def draft_config(spec: SpeculativeConfig) -> ModelConfig:
    """The draft model's config (ValueError naming the path when there is none); for a
    DFlash drafter, its layers' (what its cache holds per token)."""
    from specdec.checkpoint import load_config

    if not Path(spec.model).exists():
        raise ValueError(f"Draft model path {spec.model!r} does not exist.")
    if spec.method == "dflash":
        return dflash.read_config(spec.model).model
    return load_config(spec.model)


def _model_drafter(spec: SpeculativeConfig, *, target_path, target_config, num_slots,
                   max_model_len, plan: Plan, num_blocks: int | None = None):  # fmt: skip
    draft_config(spec)  # the path checked first, with its own message
    draft_path = Path(spec.model)
    cfg, params = load_model(draft_path, dtype=plan.dtype)
    limit = _vocab_limit(target_path, target_config, draft_path, cfg)
    tree = plan.tree
    return ModelDrafter(
        cfg, params, num_slots=num_slots, max_model_len=max_model_len, num_nodes=tree.num_nodes,
        max_depth=tree.max_depth, topk=tree.topk, vocab_limit=limit, num_blocks=num_blocks,
    )  # fmt: skip


def _ngram_drafter(spec: SpeculativeConfig, *, target_path, target_config, num_slots,
                   max_model_len, plan: Plan, num_blocks: int | None = None):  # fmt: skip
    tree = plan.tree
    return NgramDrafter(
        num_slots=num_slots, num_nodes=tree.num_nodes, max_depth=tree.max_depth,
        topk=tree.topk, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
        vocab_size=target_config.vocab_size,
    )  # fmt: skip


def _dflash_drafter(spec: SpeculativeConfig, *, target_path, target_config, num_slots,
                    max_model_len, plan: Plan, num_blocks: int | None = None):  # fmt: skip
    draft_config(spec)  # the path checked first, with its own message
    dcfg, params = dflash.load(spec.model, dtype=plan.dtype)
    tree = plan.tree
    return BlockDrafter(
        dcfg, params, num_slots=num_slots, max_model_len=max_model_len,
        num_nodes=tree.num_nodes, max_depth=tree.max_depth, topk=tree.topk,
        vocab_limit=target_config.vocab_size, num_blocks=num_blocks,
    )  # fmt: skip


DRAFTERS = {"draft_model": _model_drafter, "dflash": _dflash_drafter, "ngram": _ngram_drafter}


def build_drafter(spec: SpeculativeConfig, *, plan: Plan, **kwargs) -> Drafter:
    """The drafter `spec.method` names, with the plan's tree (see DRAFTERS)."""
    if plan.tree is None:
        raise ValueError("build_drafter needs a plan made with the speculative config.")
    return DRAFTERS[spec.method](spec, plan=plan, **kwargs)
