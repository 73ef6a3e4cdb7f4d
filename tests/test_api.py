"""LLM API: input validation (vLLM-style errors), stop rules, seeds, outputs and metrics."""

import re

import pytest
from fixtures import tiny_pair

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=64, max_num_seqs=4)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -1}, "top_k must be 0 (disable) or a positive integer, got -1."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty, got ''."),
        ({"stop": ""}, "stop strings must be non-empty, got ''."),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match=r"Prompt 1 is empty; the prompt must not be empty"):
        llm.generate(["ok", ""], use_tqdm=False)
    with pytest.raises(ValueError, match=r"Prompt 0 is empty \(no tokens\)"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)


def test_token_out_of_vocabulary(llm):
    v = llm.config.vocab_size
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"Prompt 0: token id {v} at position 1 is out of vocabulary "
            f"(allowed: integers in [0, {v}))."
        ),
    ):
        llm.generate([{"prompt_token_ids": [1, v]}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id -1 at position 0 is out of vocabulary"):
        llm.generate([{"prompt_token_ids": [-1]}], use_tqdm=False)


def test_prompt_too_long(llm):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Prompt 0 is too long: 64 prompt tokens + at least 1 output token = 65 > "
            "max_model_len = 64."
        ),
    ):
        llm.generate([{"prompt_token_ids": [1] * 64}], use_tqdm=False)
    # 63 tokens + 1 output fits exactly: one token, finish_reason "length".
    out = llm.generate([{"prompt_token_ids": [1] * 63}], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_params_list_length_mismatch(llm):
    with pytest.raises(
        ValueError,
        match=re.escape("The lengths of prompts (2) and sampling_params (3) must be the same."),
    ):
        llm.generate(["a", "b"], [GREEDY] * 3, use_tqdm=False)


def test_bad_input_does_no_work(llm):
    """Validation covers every prompt before any request starts."""
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [10**9]}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_constructor_args(model_dir, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[2, 256\]"):
        LLM(model_dir, max_model_len=10_000)
    with pytest.raises(ValueError, match="dtype must be"):
        LLM(model_dir, dtype="int8")
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM(model_dir, max_num_seqs=0)


def test_bad_speculative_config():
    with pytest.raises(
        ValueError, match=r"method must be one of \['draft_model', 'dflash', 'ngram'\]"
    ):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="needs model="):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="topk must be >= 1, got 0"):
        SpeculativeConfig(method="ngram", topk=0)
    with pytest.raises(ValueError, match="method='ngram' drafts from the sequence itself"):
        SpeculativeConfig(method="ngram", model="some/draft")
    with pytest.raises(ValueError, match=r"Unknown speculative_config keys \['foo'\]"):
        SpeculativeConfig.from_dict({"method": "ngram", "foo": 1})


# ----------------------------------------------------------------------------- stop rules


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy 24-token continuations without stop rules."""
    prompts = ["def fib(n):", "for i in range", "class Point:"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_max_tokens_one(llm, reference):
    prompts, ref = reference
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for o, r in zip(outs, ref, strict=True):
        assert o.outputs[0].token_ids == r[:1]
        assert o.outputs[0].finish_reason in ("length", "stop")


def test_stop_token_ids_end_output(llm, reference):
    prompts, ref = reference
    for prompt, r in zip(prompts, ref, strict=True):
        stop = r[5]
        cut = r.index(stop) + 1
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
        out = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == r[:cut]
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_eos_ends_output_unless_ignored(model_dir, reference):
    prompts, ref = reference
    r = ref[0]
    # Declare the 4th generated token to be EOS via a tokenizer config override.
    llm = LLM(model_dir, max_model_len=64, max_num_seqs=2)
    llm.engine.eos_token_ids = frozenset([r[3]])
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == r[: r.index(r[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == r and out.finish_reason == "length"


def test_stop_string_spanning_tokens_trims_text_and_ids(llm, model_dir, reference):
    tok = Tokenizer.from_pretrained(model_dir)
    prompts, ref = reference
    checked = 0
    for prompt, r in zip(prompts, ref, strict=True):
        # A stop string made of the last character of token k-1's text and the first of
        # token k's, at the first boundary where both decode cleanly.
        stop, full = None, tok.decode(r)
        for k in range(3, len(r) - 1):
            left, both = tok.decode(r[:k]), tok.decode(r[: k + 1])
            if left and len(both) > len(left) and full.startswith(both):
                candidate = left[-1] + both[len(left)]
                if "\ufffd" not in candidate:
                    stop = candidate
                    break
        if stop is None:
            continue
        # Expected: the shortest token prefix whose text contains the stop string.
        n = next(k for k in range(1, len(r) + 1) if stop in tok.decode(r[:k]))
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        out = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == r[:n]
        assert out.text == full[: full.index(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        checked += 1
    assert checked >= 1


def test_never_exceeds_max_tokens(llm):
    for m in (1, 2, 3, 7):
        p = SamplingParams(temperature=0.8, max_tokens=m, seed=m, ignore_eos=True)
        for o in llm.generate(["def", "class"], p, use_tqdm=False):
            assert len(o.outputs[0].token_ids) == m
            assert o.outputs[0].finish_reason == "length"


# ----------------------------------------------------------------------------- seeds, outputs


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["def fib(n):"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=5, seed=s) for s in range(3)]
    batch = llm.generate(
        ["x = 1", "def fib(n):", "for", "class"], [others[0], p, others[1], others[2]],
        use_tqdm=False,
    )  # fmt: skip
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["def fib(n):"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_outputs_shape_and_metrics(llm):
    outs = llm.generate(["def fib(n):", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["def fib(n):", None]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].request_id != outs[1].request_id
    for o in outs:
        assert o.finished
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
        assert o.metrics.tpot is not None and o.metrics.tpot >= 0
        assert len(o.outputs[0].token_ids) == 24


def test_chat_uses_template(model_dir):
    import json

    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(model_dir, max_model_len=64, max_num_seqs=2)
    tok = llm.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("<user>hi\n<assistant>", add_special_tokens=False)


@pytest.mark.parametrize(
    "declared, expected",
    [({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "bfloat16"}, "bfloat16"),
     ({"torch_dtype": "float32"}, "float32"), ({"torch_dtype": "float16"}, "float32"),
     ({}, "float32")],
)  # fmt: skip
def test_auto_dtype_follows_a_bfloat16_checkpoint(tmp_path, declared, expected):
    """dtype="auto" on CPU: bfloat16 checkpoints stay bfloat16, everything else float32."""
    import json

    from specdec.plan import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **declared}))
    assert resolve_dtype(tmp_path) == expected
    assert resolve_dtype(tmp_path, "float32") == "float32"  # an explicit dtype stays
