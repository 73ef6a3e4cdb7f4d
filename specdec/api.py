"""`LLM`: the vLLM-shaped front door.

from specdec import LLM, SamplingParams
llm = LLM(model="path/to/hf_folder")
out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
from tqdm.auto import tqdm

from specdec.checkpoint import load_config, load_model
from specdec.engine import LLMEngine, WorkerLostError
from specdec.outputs import RequestOutput, SpecDecodeMetrics
from specdec.params import SamplingParams, SpeculativeConfig, broadcast_params, generation_defaults
from specdec.plan import (
    PLAN_SLOTS,
    Plan,
    TreeShape,
    dtype_rows,
    make_plan,
    resolve_dtype,
    verify_rows,
)
from specdec.tokenizer import Tokenizer
from specdec.workers import (
    KernelName,
    TargetWorker,
    build_drafter,
    draft_config,
    kv_pool,
    resolve_kernel,
)

if TYPE_CHECKING:
    from specdec.cluster.config import ClusterConfig

PromptType = str | Mapping[str, Any]
DTypeName = Literal["auto", "float32", "bfloat16"]
_counter = itertools.count()


class LLM:
    """Loads a Hugging Face model folder and generates from it.

    Args:
        model: folder with config.json, safetensors weights and (for text prompts)
            tokenizer.json.
        dtype: weight dtype; "auto" = bfloat16 off CPU; on CPU float32, except
            that a bfloat16 checkpoint stays bfloat16 unless float32 products time
            faster both for one request's step and for a batch of min(max_num_seqs, 8)
            on this CPU (`plan.resolve_dtype`). On Ray, each
            actor decides on its own host; `LLM.dtype` is then the target's.
        max_model_len: prompt + output tokens per sequence at most; default
            min(max_position_embeddings, 4096).
        max_num_seqs: sequences decoded together at most (default 256, as in vLLM).
            A step runs over the running sequences only, so unused slots cost
            nothing; how many run at once is set by the KV cache's blocks.
        kv_cache_memory: bytes of KV cache, target and draft together (paged:
            blocks of 16 positions taken as sequences grow, `kernels.blocks`);
            default: a share of the free device memory (on a CPU host 10% of the
            available RAM, on an accelerator 80% of what is free), never more than
            `max_num_seqs` sequences of `max_model_len` tokens can use. Requests
            that do not fit wait (continuous batching); a budget below one
            `max_model_len` sequence is refused.
        speculative_config: a `SpeculativeConfig` or an equivalent dict; None = plain
            autoregressive decoding.
        seed: seeds the per-request seeds of requests that give none.
        kernel: the target's verify step: "megakernel" (the Pallas kernel; interpret
            mode off TPU), "xla" (jitted reference path) or "auto" (megakernel on TPU,
            XLA elsewhere and for targets it cannot split, such as MoE).
        cluster: run the draft and the target as Ray actors on separate resource
            groups (`specdec.cluster.ClusterConfig`); the step loop stays here.
        distributed_executor_backend: "ray" = the same with a default ClusterConfig
            (one host per group) when `cluster` is None.
        tensor_parallel_size: shard the target over the first n local devices (heads,
            FFN columns / rows and the vocabulary split n ways). The XLA path lets
            XLA insert the collectives; the megakernel runs one instance per device
            with its all-reduces inside (`kernels.megakernel.shard`). A model the
            megakernel cannot split n ways takes XLA under "auto" and is refused
            with kernel="megakernel". On Ray the target's group size
            (`GroupConfig.num_devices`) plays this part.
        compile_at_start: compile, before returning, every program a request of up
            to `max_model_len` tokens can run (`LLMEngine.compile_shapes`, behind a
            progress bar), so no request waits on a compile mid-run; programs are
            kept in the persistent compile cache ($SPECDEC_CACHE/xla), so later
            starts load them. Off by default: it costs start-up time (minutes for
            a large `max_model_len` on a first start) that one-off runs never win back.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: DTypeName = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory: int | None = None,
        tokenizer: str | os.PathLike | None = None,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
        seed: int = 0,
        kernel: KernelName = "auto",
        cluster: ClusterConfig | None = None,
        distributed_executor_backend: Literal["ray"] | None = None,
        compile_at_start: bool = False,
        tensor_parallel_size: int = 1,
    ):
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}.")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}.")
        if kv_cache_memory is not None and (
            not isinstance(kv_cache_memory, int) or kv_cache_memory < 1
        ):
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}."
            )
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}."
            )
        local = jax.local_devices()
        if tensor_parallel_size > len(local):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs that many local devices; "
                f"JAX sees {len(local)} ({local[0].platform})."
            )
        folder = Path(model)
        if not folder.exists():
            raise ValueError(f"Model path {str(model)!r} does not exist.")
        if distributed_executor_backend not in (None, "ray"):
            raise ValueError(
                f"distributed_executor_backend must be None or 'ray', got "
                f"{distributed_executor_backend!r}."
            )
        remote = cluster is not None or distributed_executor_backend == "ray"
        if remote and tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size shards an in-process target; on Ray the target group's "
                "GroupConfig(num_devices=...) sets how many devices it is sharded over."
            )
        self.model_path = folder
        self.generation_defaults = generation_defaults(folder)  # checked before any loading
        if isinstance(speculative_config, Mapping):
            speculative_config = SpeculativeConfig.from_dict(dict(speculative_config))
        if speculative_config is not None and not isinstance(speculative_config,
                                                             SpeculativeConfig):  # fmt: skip
            raise ValueError(
                "speculative_config must be a SpeculativeConfig, a dict of its fields or "
                f"None, got {type(speculative_config).__name__}."
            )
        # "auto" is timed for the rows a step verifies, on the host that runs them: here,
        # or in each Ray actor (the target's choice is read back from it below).
        self.dtype = dtype
        self.plan: Plan | None = None  # in-process only: each Ray actor plans on its host
        if remote and speculative_config is not None and speculative_config.method == "dflash":
            raise ValueError(
                "method='dflash' runs in process for now (the drafter reads the target's "
                "hidden states); drop the cluster, or use method='draft_model' on it."
            )
        if remote:  # the weights load in the target actor, not here
            self.config, params = load_config(folder), None
        else:
            rows = dtype_rows(verify_rows(speculative_config, 1), max_num_seqs)
            self.dtype = resolve_dtype(folder, dtype, rows=rows)
            self.config, params = load_model(folder, dtype=self.dtype)
        if kernel not in ("auto", "megakernel", "xla"):
            raise ValueError(f"kernel must be 'auto', 'megakernel' or 'xla', got {kernel!r}.")
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, 4096)
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be an integer in [2, {limit}] (the model's "
                f"max_position_embeddings), got {max_model_len!r}."
            )
        self.max_model_len = max_model_len
        tok_folder = Path(tokenizer) if tokenizer is not None else folder
        self.tokenizer = (
            Tokenizer.from_pretrained(tok_folder)
            if (tok_folder / "tokenizer.json").is_file() or tokenizer is not None
            else None
        )
        self.speculative_config = speculative_config
        self.cluster = None  # the Ray actors' handle (`shutdown()`), when remote
        if remote:
            from specdec.cluster.remote import remote_workers  # the one upward import

            target, drafter = remote_workers(
                cluster, model=folder, dtype=self.dtype, model_config=self.config,
                speculative_config=speculative_config, num_slots=max_num_seqs,
                max_model_len=max_model_len, kernel=kernel, kv_cache_memory=kv_cache_memory,
            )  # fmt: skip
            self.cluster = target.cluster
            self.dtype = target.info.get("dtype", self.dtype)
        else:
            # Every timing-dependent choice, made once here (specdec/plan.py).
            model_drafter = speculative_config is not None and (
                speculative_config.method in ("draft_model", "dflash")
            )  # its trees stay on the device: verified at full width only
            self.plan = make_plan(self.config, dtype=self.dtype, spec=speculative_config,
                                  num_slots=PLAN_SLOTS, host_trees=not model_drafter)  # fmt: skip
            tree_nodes = self.plan.tree.num_nodes if self.plan.tree is not None else 0
            draft_cfg = draft_config(speculative_config) if model_drafter else None
            max_num_seqs, num_blocks = kv_pool(
                self.config, draft_cfg, self.dtype, budget=kv_cache_memory,
                num_slots=max_num_seqs, max_len=max_model_len + tree_nodes + 1,
                kernel=resolve_kernel(kernel, self.config, tensor_parallel_size),
            )  # fmt: skip
            drafter = None
            if speculative_config is not None:
                drafter = build_drafter(
                    speculative_config, plan=self.plan, target_path=folder,
                    target_config=self.config, num_slots=max_num_seqs, max_model_len=max_model_len,
                    num_blocks=num_blocks,
                )  # fmt: skip
            mesh = None
            if tensor_parallel_size > 1:
                from specdec.kernels.sharding import make_mesh

                mesh = make_mesh(local[:tensor_parallel_size])
            target = TargetWorker(
                self.config, params, num_slots=max_num_seqs, max_model_len=max_model_len,
                max_tree_nodes=drafter.max_nodes if drafter is not None else 0, kernel=kernel,
                plan=self.plan, mesh=mesh, num_blocks=num_blocks,
            )  # fmt: skip
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.last_generate_metrics: dict = {}
        self.engine = LLMEngine(
            target,
            self.tokenizer,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            eos_token_ids=eos,
            drafter=drafter,
            seed=seed,
            vocab_size=self.config.vocab_size,
        )
        # One engine, many callers: whoever holds the lock steps the engine for every
        # running request (its own and other threads'), so concurrent `generate`
        # calls share one continuous batch.
        self._lock = threading.RLock()
        self._requests: dict[str, Any] = {}  # request id -> the engine's sequence (`add_request`)
        if compile_at_start:
            enable_compilation_cache()
            self.engine.compile_shapes(progress=True)

    # ------------------------------------------------------------------ input checks

    def _prompt_ids(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        vocab = self.config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"Prompt {index} is empty; the prompt must not be empty.")
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.model_path} has no tokenizer.json, so text prompts cannot be "
                    "encoded; pass {'prompt_token_ids': [...]} instead."
                )
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str):
                raise ValueError(
                    f"Prompt {index}: prompt_token_ids must be a list of ints, got {type(ids)}."
                )
            ids = list(ids)
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"], index)
        else:
            raise ValueError(
                f"Prompt {index} must be a str or a dict with 'prompt_token_ids' (or "
                f"'prompt'), got {type(prompt).__name__}."
            )
        if not ids:
            raise ValueError(f"Prompt {index} is empty (no tokens); the prompt must not be empty.")
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(
                    f"Prompt {index}: token id {t!r} at position {j} is out of vocabulary "
                    f"(allowed: integers in [0, {vocab}))."
                )
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"Prompt {index} is too long: {len(ids)} prompt tokens + at least 1 output "
                f"token = {len(ids) + 1} > max_model_len = {self.max_model_len}."
            )
        return text, ids

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = broadcast_params(sampling_params, len(prompts), self.get_default_sampling_params())
        if self.tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need a tokenizer; this model folder has none.")
        checked = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]  # all before any work
        with self._lock:
            seqs = [
                self.engine.add_request(f"{next(_counter)}", text, ids, p)
                for (text, ids), p in zip(checked, params, strict=True)
            ]
        started = time.perf_counter()
        with tqdm(
            total=len(seqs), desc="Processed prompts", disable=not use_tqdm, unit="req"
        ) as bar:
            done = 0
            while done < len(seqs):
                self._step_until_finished(seqs)
                now_done = sum(s.finished for s in seqs)
                bar.update(now_done - done)
                done = now_done
        outputs = [s.output() for s in seqs]
        self.last_generate_metrics = _call_metrics(outputs, time.perf_counter() - started)
        return outputs

    def _step_until_finished(self, seqs) -> None:
        """One engine step unless every sequence in `seqs` has finished (perhaps by
        another thread's step while this one waited for the lock)."""
        with self._lock:
            if not all(s.finished for s in seqs):
                self.engine.step()

    def generate_stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[tuple[str, RequestOutput]]:
        """Generates for one prompt, yielding (new text, output so far) after each step.

        Text that could still turn out to be the start of a stop string is held
        back until it cannot; the deltas concatenate to the final `text`.
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json; streaming text needs one.")
        seq = self._enqueue(prompt, sampling_params)
        hold = max((len(x) for x in seq.params.stop or ()), default=1) - 1
        sent = 0
        while not seq.finished:
            self._step_until_finished([seq])
            with self._lock:
                out = seq.output()
            visible = out.outputs[0].text
            end = len(visible) if out.finished else max(sent, len(visible) - hold)
            yield visible[sent:end], out
            sent = end

    # ------------------------------------------------------------------ request API

    def add_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> str:
        """Queues one request for `step` to run; returns its id (given, or a fresh one).

        The prompt is checked here (ValueError naming the problem). Requests added
        this way join the running batch of every other caller of this `LLM`.
        """
        return self._enqueue(prompt, sampling_params, request_id, report=True).request_id

    def _enqueue(self, prompt, sampling_params, request_id=None, *, report: bool = False):
        """Checks one prompt and its sampling parameters (outside the lock: other
        callers keep stepping) and queues it on the engine; with `report`, `step`
        reports it (`add_request`)."""
        params = broadcast_params(sampling_params, 1, self.get_default_sampling_params())[0]
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model folder has none.")
        text, ids = self._prompt_ids(prompt, 0)
        with self._lock:
            rid = f"{next(_counter)}" if request_id is None else str(request_id)
            if report and rid in self._requests:
                raise ValueError(f"request_id {rid!r} is already running; ids must be unique.")
            seq = self.engine.add_request(rid, text, ids, params)
            if report:
                self._requests[rid] = (seq, -1)
            return seq

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the output so far of every request added with
        `add_request` that gained tokens or finished since the last `step`. A finished
        request is reported once (`RequestOutput.finished`), then forgotten."""
        with self._lock:
            if self.engine.has_unfinished_requests():
                self.engine.step()
            outputs = []
            for rid, (seq, reported) in list(self._requests.items()):
                if seq.finished or len(seq.output_ids) != reported:
                    outputs.append(seq.output())
                    self._requests[rid] = (seq, len(seq.output_ids))
                if seq.finished:
                    del self._requests[rid]
            return outputs

    def abort_request(self, request_id: str) -> bool:
        """Ends a request added with `add_request` (a client that went away): its slot
        and KV blocks free at once, and the next `step` reports it once with
        finish_reason "abort". False if no such request is running."""
        with self._lock:
            entry = self._requests.get(str(request_id))
            if entry is None:
                return False
            self.engine.abort_request(entry[0])
            return True

    def has_unfinished_requests(self) -> bool:
        """Whether any request (of any caller) is waiting or running."""
        with self._lock:
            return self.engine.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        """Requests queued but not yet admitted to the batch."""
        with self._lock:
            return len(self.engine.waiting)

    @property
    def max_num_seqs(self) -> int:
        """Sequences decoded together (the batch's slots)."""
        return self.engine.max_num_seqs

    @property
    def last_error(self) -> WorkerLostError | None:
        """Why requests last ended with finish_reason="error" (a worker lost for good)."""
        return self.engine.last_error

    @property
    def kernel(self) -> str:
        """The target's verify backend that runs: "megakernel" or "xla"."""
        target = self.engine.target
        return target.info["kernel"] if self.cluster is not None else target.kernel

    @property
    def tree(self) -> TreeShape | None:
        """The drafter's tree per step; None for plain decoding. In process, what the
        drafter grows (the plan's shape within the drafter's own bounds, e.g. a DFlash
        block's depth); on Ray the draft actor sizes an "auto" tree: its node count is
        read back, depth and topk are the speculative config's bounds."""
        if self.plan is not None:
            d, tree = self.engine.drafter, self.plan.tree
            if tree is None or not all(hasattr(d, a) for a in ("max_nodes", "max_depth", "topk")):
                return tree
            return TreeShape(int(d.max_nodes), int(d.max_depth), int(d.topk))
        drafter, spec = self.engine.drafter, self.speculative_config
        if drafter is None or spec is None:
            return None
        return TreeShape(int(drafter.max_nodes), spec.max_depth, spec.topk)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json; chat needs one.")
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]
        prompts = []
        for conversation in messages:
            ids = self.tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                **dict(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def cluster_stats(self) -> dict | None:
        """On the Ray backend: the target actors' info, their recovery times (s) and the
        draft's overlap figures; None in-process."""
        if self.cluster is None:
            return None
        target, drafter = self.engine.target, self.engine.drafter
        return {
            "target": target.info,
            "target_recoveries_s": target.recoveries,
            "overlap": drafter.overlap_stats() if drafter is not None else None,
        }

    def shutdown(self) -> None:
        """Stops the Ray actors of the Ray backend (nothing to do in-process)."""
        if self.cluster is not None:
            self.cluster.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses without sampling_params: SamplingParams'
        defaults with the fields the model's generation_config.json sets (as vLLM)."""
        return SamplingParams(**self.generation_defaults)

    def get_metrics(self) -> dict:
        """Running speculative-decoding totals since this LLM was built (vLLM's names).

        `llm.last_generate_metrics` holds the same figures for the latest `generate`
        call alone, with mean TTFT / TPOT and output tokens/s.
        """
        return self.engine.spec_metrics.as_dict()


def _call_metrics(outputs: list[RequestOutput], seconds: float) -> dict:
    """Speculation totals, timing means and throughput of one generate call."""
    spec = SpecDecodeMetrics()
    for o in outputs:
        spec.merge(o.metrics.spec)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return spec.as_dict() | {
        "num_requests": len(outputs),
        "num_output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "mean_ttft": sum(ttfts) / len(ttfts) if ttfts else None,
        "mean_tpot": sum(tpots) / len(tpots) if tpots else None,
    }


def enable_compilation_cache() -> None:
    """Reuse XLA compilations across runs (first run compiles, later ones start fast)."""
    cache = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "xla"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if jax.config.jax_compilation_cache_dir not in (None, str(cache)):
            # jax keeps using the folder it first opened unless told to reopen.
            from jax.experimental.compilation_cache import compilation_cache

            compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", str(cache))
        # Every program, however quick to compile: the quick ones add up.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    except OSError:
        pass  # read-only home: just compile every time
