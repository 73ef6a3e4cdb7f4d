"""The step loop: batched (speculative) decoding over a fixed set of KV-cache slots.

Walk-through of one `LLMEngine.step()`:

1. **Admit.** Waiting requests take free slots (FIFO) while the KV cache has
   blocks for them (`kv_blocks`: each running sequence counts the blocks its
   tokens plus one step's growth need); the first that does not fit waits, and
   so does everyone behind it. Their prompts are prefilled into the target's
   cache in one batch and the first output token is sampled; that token is the
   sequence's *root* (committed, K/V not yet cached). The drafter, if any, is
   told about the new sequence (`Drafter.start`). Before each step, if the
   running sequences' growth no longer fits, the latest admitted are preempted:
   their blocks freed, they go back to the front of the queue with their output
   so far, and on readmission their prompt plus output is prefilled again (the
   recompute preemption of vLLM) and decoding goes on from their last token.
2. **Propose.** The drafter grows one token tree per running sequence, padded to
   a fixed node count so nothing re-traces (`Drafter.propose`). Without a drafter
   the tree is empty and the step is plain autoregressive decoding.
3. **Verify.** The target scores `[root, tree nodes]` in one fused call, applies
   the acceptance rule and commits the accepted path's K/V
   (`TargetWorker.verify`). Each row yields its accepted tokens plus one bonus
   token. Trees on the host (an n-gram drafter's) are verified at the narrowest
   of a few fixed widths that holds them (`workers.narrowest`): a step with no
   tree at all costs a plain decode step. Where the nodes past a narrower width
   (or all of them) are expected to win less than their verify costs, each
   tree is cut to that width (`workers.WidthChooser`).
4. **Commit.** The engine appends those tokens one by one, applying the stop
   rules *inside* the run: a stop token id, EOS (unless `ignore_eos`), a stop
   string, `max_tokens` and `max_model_len` end the output at the exact token,
   whatever the run held after it. The drafter rolls its own state forward to
   the same tokens (`Drafter.commit`). Finished sequences free their slots, so
   sequences join and leave the batch independently.

Everything that varies per request (sampling parameters, seed, counter) travels
as flat arrays (`SamplingBatch`); row s of every array is slot s. The workers
run each step over the live slots only (`runner.live_rows`), so a slot count in
the hundreds costs nothing while those slots are empty.

A worker that is gone for good (a remote target whose restarts are exhausted)
raises `WorkerLostError`; the step then ends every unfinished request with
`finish_reason="error"`, keeping the tokens already committed, and logs why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import jax
import numpy as np

from specdec.draft.base import DraftBatch, Drafter
from specdec.draft.block import BlockDrafter
from specdec.draft.model import ModelDrafter
from specdec.kernels.runner import kv_bucket, row_bucket
from specdec.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SpecDecodeMetrics,
)
from specdec.params import SamplingParams
from specdec.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.verify.batch import SamplingBatch
from specdec.workers import TargetWorker

logger = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """A worker died and cannot come back; the message names it and what was lost."""


def request_seed(seed: int) -> int:
    """A user seed (any int in [0, 2**63)) folded into the u32 the PRNG takes."""
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


@dataclasses.dataclass
class Sequence:
    """One request's state inside the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # u32
    metrics: RequestMetrics
    detok: IncrementalDetokenizer | None
    slot: int = -1
    root: int = -1
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    number: int = 0  # arrival order in this engine (preemption takes the highest first)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    stop_text_end: int | None = None  # where a stop string starts in the text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        text = self.text if self.stop_text_end is None else self.text[: self.stop_text_end]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
        )


class LLMEngine:
    """Batched speculative decoding over `target` (and `drafter`, if any)."""

    def __init__(
        self,
        target: TargetWorker,
        tokenizer: Tokenizer | None,
        *,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        drafter: Drafter | None = None,
        seed: int = 0,
        vocab_size: int | None = None,  # needed for repetition_penalty
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * max_num_seqs
        self.spec_metrics = SpecDecodeMetrics()
        self.last_error: WorkerLostError | None = None  # why requests last ended in "error"
        self._rng = np.random.default_rng(seed)
        if getattr(drafter, "target_layers", None):  # a block drafter reads the target
            if not isinstance(target, TargetWorker):
                raise ValueError(
                    "A block drafter (method='dflash') reads the target's hidden states "
                    "in process; it does not run on a Ray cluster yet."
                )
            drafter.bind(target)
        # KV capacity in blocks: the target's, or the draft's if it holds fewer (a
        # draft holds at most the target's positions, `workers.kv_pool`).
        self.block_size, self.num_blocks, self.kv_max_len = target.kv_capacity()
        draft_cap = getattr(drafter, "kv_capacity", lambda: None)()
        if draft_cap is not None and draft_cap[0] == self.block_size:
            self.num_blocks = min(self.num_blocks, draft_cap[1])
        # A step writes the root (the last token, not yet cached) and up to a whole
        # tree after it; one position more keeps a margin.
        self.growth = (drafter.max_nodes if drafter is not None else 0) + 1
        self.num_preemptions = 0
        self._arrivals = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Sequence:
        if params.repetition_penalty != 1 and self.vocab_size is None:
            raise ValueError("repetition_penalty needs the engine's vocab_size.")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        seq = Sequence(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=request_seed(seed),
            metrics=RequestMetrics(arrival_time=arrival_time or time.perf_counter()),
            detok=detok,
        )
        self._arrivals += 1
        seq.number = self._arrivals
        self.waiting.append(seq)
        return seq

    def abort_request(self, seq: Sequence) -> None:
        """Ends `seq` now (finish_reason "abort", output so far kept) and frees its slot
        and KV blocks, or its place in the queue. Nothing if it already finished."""
        if seq.finished:
            return
        queued = [s for s in self.waiting if s is not seq]
        if len(queued) < len(self.waiting):
            self.waiting = deque(queued)
        elif seq.slot >= 0:
            self._release(seq)
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.perf_counter()

    def kv_blocks(self, seq: Sequence, extra: int = 0) -> int:
        """Cache blocks `seq` holds by the end of its next step (with `extra` more tokens)."""
        n = len(seq.prompt_token_ids) + len(seq.output_ids) + extra + self.growth
        return -(-min(n, self.kv_max_len) // self.block_size)

    def kv_blocks_used(self) -> int:
        """Blocks the running sequences hold by the end of the next step."""
        return sum(self.kv_blocks(s) for s in self.slots if s is not None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    # ------------------------------------------------------------------ compiling

    def compile_shapes(self, *, progress: bool = False) -> int:
        """Runs every program a request of up to `max_model_len` tokens can need, on
        dummy data in slot 0, so that no request waits on a compile once serving
        starts. Returns the number of dummy runs (0 for remote workers, which compile
        on their own hosts).

        The programs: the prefill of each chunk shape of a prompt (`prefill_shapes`:
        target and draft), the first-token draw, and one step (propose, verify,
        commit) at every K/V length a step can read (`kv_bucket`), at every tree
        width the target verifies (host trees are cut to `verify_widths`), each with
        and without a repetition penalty (the penalty adds a `seen` operand: another
        program), for every row count a step runs (`runner.row_bucket`: 1, 2, 4, ...
        up to max_num_seqs). The slots used are released after each run; nothing
        is left behind.

        With the persistent compilation cache on (`LLM(compile_at_start=True)`
        turns it on), each row count's programs are dropped from memory once
        compiled: every compiled XLA CPU program maps its code pages, and the
        whole grid in one process would pass the kernel's limit on mappings
        (vm.max_map_count, 65530) and crash. A shape's first use then loads
        its program from the cache (a trace and a load, no compile).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("compile_shapes needs an idle engine (no request running).")
        target, drafter = self.target, self.drafter
        if not isinstance(target, TargetWorker):
            logger.info("compile_shapes: remote workers compile on their own hosts")
            return 0
        from tqdm.auto import tqdm

        r, s = target.runner, self.max_num_seqs
        variants = [SamplingBatch.make_dummy(s)]
        if self.vocab_size is not None:  # the penalised form is another program
            variants.append(SamplingBatch.make_dummy(s, self.vocab_size))
        first = [v.take(1) for v in variants]
        lengths = r.prefill_shapes(self.max_model_len - 1)
        # What a step reads K/V from (each has `max_len` and per-slot `reserved`).
        runners = [r] + ([drafter.runner] if isinstance(drafter, ModelDrafter) else
                         [drafter] if isinstance(drafter, BlockDrafter) else [])  # fmt: skip
        kv_lens = sorted({kv_bucket(x, q.max_len) for q in runners for x in range(q.max_len + 1)})
        nodes = drafter.max_nodes if drafter is not None else 0
        widths = target.plan.widths  # full width for a model drafter's device trees
        buckets = sorted({row_bucket(n, s) for n in range(1, s + 1)})
        steps = len(kv_lens) * len(variants) * len(widths)
        total = len(lengths) + len(first) - 1 + len(buckets) * (steps + 1)
        bar = tqdm(total=total, desc="compiling", unit="shape", disable=not progress)
        saved, target.widths = target.widths, None  # verify each width as asked
        try:
            for i, n in enumerate(lengths):
                for v in first if i == 0 else first[:1]:
                    self._dummy_prefill([[1] * n], v)
                    self._dummy_release(1)
                    bar.update(1)
            for i, b in enumerate(buckets):
                if i and jax.config.jax_compilation_cache_dir:
                    jax.clear_caches()  # they are on disk; see the docstring
                for v in first[:1]:  # the first-token draw of b prompts admitted together
                    self._dummy_prefill([[1]] * b, v.padded(b))
                    self._dummy_release(b)
                    bar.update(1)
                for k in kv_lens:
                    for v in variants:
                        for w in widths:
                            self._dummy_step(b, k, v, w, nodes, runners)
                            bar.update(1)
        finally:
            target.widths = saved
            bar.close()
        return total

    def _dummy_prefill(self, prompts: list[list[int]], sampling: SamplingBatch) -> np.ndarray:
        """Prefills `prompts` into slots 0, 1, ...; returns their roots."""
        slots = list(range(len(prompts)))
        roots = np.asarray(self.target.prefill(slots, prompts, sampling), np.int32)
        if self.drafter is not None:
            self.drafter.start(slots, prompts, roots.tolist())
        return roots

    def _dummy_step(self, b: int, kv_len: int, sampling: SamplingBatch, width: int, nodes: int,
                    runners) -> None:  # fmt: skip
        """One step (propose, verify, commit) over slots 0 .. b - 1 reading kv_len positions."""
        s, drafter = self.max_num_seqs, self.drafter
        roots = np.zeros(s, np.int32)
        roots[:b] = self._dummy_prefill([[1]] * b, sampling.take(b).padded(b))
        for q in runners:
            q.reserved[:b] = kv_len  # the step reads kv_len positions (`kv_len`)
        active = np.zeros(s, bool)
        active[:b] = True
        if isinstance(drafter, (ModelDrafter, BlockDrafter)):  # trees grown on the device
            tree = drafter.propose(active, roots, sampling)
        else:
            tree = _dummy_tree(s, nodes, width, b)
        emitted, num, accepted = self.target.verify(roots, tree, active, sampling)
        if drafter is not None:
            drafter.commit(active, accepted, num, emitted)
        self._dummy_release(b)

    def _dummy_release(self, b: int) -> None:
        for slot in range(b):
            self.target.release(slot)
            if self.drafter is not None:
                self.drafter.release(slot)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Sequence]:
        """Admits, decodes one speculative step; returns sequences that changed."""
        try:
            self._preempt()
            changed = self._admit()
            active = np.array([s is not None and not s.finished for s in self.slots])
            if active.any():
                changed += self._decode(active)
        except WorkerLostError as e:
            return self._fail_all(e)
        for s in changed:
            if s.finished and s.slot >= 0:
                self._release(s)
        return changed

    def _sampling(self, seqs: list[Sequence | None]) -> SamplingBatch:
        n = len(seqs)
        b = SamplingBatch.make_dummy(n)
        for i, s in enumerate(seqs):
            if s is None:
                continue
            p = s.params
            b.temperature[i] = p.temperature
            b.top_k[i] = p.top_k
            b.top_p[i] = p.top_p
            b.min_p[i] = p.min_p
            b.seed[i] = s.seed
            b.counter[i] = len(s.output_ids)
        penalized = [
            i for i, s in enumerate(seqs) if s is not None and s.params.repetition_penalty != 1
        ]
        if not penalized:
            return b
        # Each penalised row's prompt + output so far (the verify adds the tree paths).
        pen = np.ones(n, np.float32)
        seen = np.zeros((n, self.vocab_size), bool)
        for i in penalized:
            s = seqs[i]
            pen[i] = s.params.repetition_penalty
            seen[i, s.prompt_token_ids] = True
            seen[i, s.output_ids] = True
        return dataclasses.replace(b, repetition_penalty=pen, seen=seen)

    def _preempt(self) -> None:
        """Frees the latest admitted sequences while the running ones' next step
        would need more blocks than the cache has (they wait at the queue's front)."""
        used = self.kv_blocks_used()
        while used > self.num_blocks:
            running = [s for s in self.slots if s is not None and not s.finished]
            if len(running) < 2:  # one sequence always fits (`blocks.num_blocks_for`)
                break
            # The latest arrival goes first, so the oldest requests keep moving.
            seq = max(running, key=lambda s: s.number)
            used -= self.kv_blocks(seq)
            self._release(seq)
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(seq)
            logger.info("preempted %s (KV cache full): it resumes when blocks free up",
                        seq.request_id)  # fmt: skip

    def _admit(self) -> list[Sequence]:
        free = [i for i, s in enumerate(self.slots) if s is None]
        new = []
        used = self.kv_blocks_used()
        while free and self.waiting:
            seq = self.waiting[0]
            need = self.kv_blocks(seq, 0 if seq.output_ids else 1)  # + the prefill's token
            if used + need > self.num_blocks:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            used += need
            seq.slot = free.pop(0)
            self.slots[seq.slot] = seq
            new.append(seq)
        if not new:
            return []
        # Each row's final length, so the whole request runs one compiled KV length
        # (`ModelRunner.reserve`); remote workers send it with the prefill / start.
        tree = self.drafter.max_nodes if self.drafter is not None else 0
        planned = [
            min(len(s.prompt_token_ids) + s.params.max_tokens, self.max_model_len) + tree + 2
            for s in new
        ]
        for worker in (self.target, self.drafter):
            if worker is not None:
                worker.reserve([s.slot for s in new], planned)
        # A preempted sequence resumes: its prompt and output but the last token go
        # in again, and the last token is its root (the draw here is not used).
        prompts = [[*s.prompt_token_ids, *s.output_ids[:-1]] for s in new]
        roots = self.target.prefill([s.slot for s in new], prompts, self._sampling(new))
        now = time.perf_counter()
        fresh = []
        for seq, root in zip(new, roots, strict=True):
            if seq.output_ids:
                seq.root = seq.output_ids[-1]
                continue
            fresh.append(seq)
            seq.metrics.first_token_time = now
            seq.root = int(root)
            self._append(seq, [seq.root])
        starting = [(s, p) for s, p in zip(new, prompts, strict=True) if not s.finished]
        if self.drafter is not None and starting:
            self.drafter.start(
                [s.slot for s, _ in starting],
                [p for _, p in starting],
                [s.root for s, _ in starting],
            )
        return fresh

    def _decode(self, active: np.ndarray) -> list[Sequence]:
        roots = np.array([s.root if s is not None else 0 for s in self.slots], np.int32)
        sampling = self._sampling(self.slots)
        if self.drafter is not None:
            tree = self.drafter.propose(active, roots, sampling)
        else:
            tree = DraftBatch.empty(self.max_num_seqs)
        emitted, num, accepted = self.target.verify(roots, tree, active, sampling)
        if self.drafter is not None:
            self.drafter.commit(active, accepted, num, emitted)
        nodes = tree.num_nodes
        changed = []
        for slot in np.flatnonzero(active):
            seq = self.slots[slot]
            run = emitted[slot, : num[slot] + 1].tolist()
            seq.metrics.spec.record(int(nodes[slot]), int(num[slot]))
            self.spec_metrics.record(int(nodes[slot]), int(num[slot]))
            self._append(seq, run)
            seq.root = run[-1]
            changed.append(seq)
        return changed

    def _fail_all(self, error: WorkerLostError) -> list[Sequence]:
        """Ends every unfinished request with finish_reason="error" (outputs so far kept)."""
        logger.error("%s", error)
        self.last_error = error
        failed = [s for s in self.slots if s is not None] + list(self.waiting)
        self.waiting.clear()
        self.slots = [None] * self.max_num_seqs
        now = time.perf_counter()
        for seq in failed:
            seq.slot = -1
            if not seq.finished:
                seq.finish_reason = "error"
                seq.metrics.finished_time = now
        return failed

    def _release(self, seq: Sequence) -> None:
        self.target.release(seq.slot)
        if self.drafter is not None:
            self.drafter.release(seq.slot)
        self.slots[seq.slot] = None
        seq.slot = -1

    # ------------------------------------------------------------------ stop rules

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Appends tokens one by one, ending the output at the first stop condition."""
        p = seq.params
        for t in tokens:
            if seq.finished:
                break
            seq.output_ids.append(t)
            seq.metrics.num_output_tokens = len(seq.output_ids)
            if seq.detok is not None:
                start = len(seq.text)
                seq.detok.update([t])
                seq.text = seq.detok.text
                if p.stop and self._check_stop_strings(seq, start):
                    break
            if p.stop_token_ids and t in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", t
            elif not p.ignore_eos and t in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens:
                seq.finish_reason = "length"
            elif len(seq.prompt_token_ids) + len(seq.output_ids) >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finished:
            seq.metrics.finished_time = time.perf_counter()

    def _check_stop_strings(self, seq: Sequence, new_from: int) -> bool:
        """Looks for a stop string overlapping the text added from `new_from` on."""
        longest = max(len(s) for s in seq.params.stop)
        lo = max(0, new_from - longest + 1)
        hits = [(seq.text.find(s, lo), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        pos, s = min(hits)
        seq.finish_reason, seq.stop_reason, seq.stop_text_end = "stop", s, pos
        seq.metrics.finished_time = time.perf_counter()
        return True


def _dummy_tree(num_slots: int, max_nodes: int, width: int, rows: int = 1) -> DraftBatch:
    """Host trees padded to `max_nodes`: slots 0 .. rows - 1 hold a chain of `width` nodes."""
    tree = DraftBatch.empty(num_slots, max_nodes)
    tree.tokens[:rows, :width] = 1
    tree.parents[:rows, :width] = np.arange(width) - 1
    return tree
