"""specdec.tokenizer against transformers' AutoTokenizer on tiny tokenizers built here.

Two tokenizers are built once per module with the `tokenizers` library:
- a byte-level BPE (GPT-2 / Llama-3 style) trained on a few sentences, with special tokens
  <s>, </s>, <|im_start|>, <|im_end|> and a TemplateProcessing post-processor adding <s>;
- a SentencePiece-style BPE (Llama-2 style: "▁" for spaces, <0xNN> byte fallback).
Each test writes a model folder around one of them and, where it compares, loads the same folder
with `transformers.AutoTokenizer` (imported only here, never by specdec).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import (
    Tokenizer as BackendTokenizer,
)
from tokenizers import (
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from specdec.tokenizer import IncrementalDetokenizer, SpecialTokens, Tokenizer, TokenizerConfig

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? speculative decoding proposes a token tree.",
    "the target model verifies every tree node in one pass.",
]
TEXTS = [
    "hello world",
    "héllo 世界 🙂",
    "",
    "  two leading spaces and trailing ",
    "<s>special tokens</s> inside <|im_start|>text<|im_end|>",
    "unseen: ζ∑ 日本語 🙂🙃 é\u0301",
]
# A plain user / assistant exchange with a system prompt; every template is tried on it.
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo 世界 🙂"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "and again?"},
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style: writes bos_token itself, strips content, named-block structure.
LLAMA3_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% set content = '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim %}
    {{ content + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\n\n' }}
{% endif %}"""
# Exercises the globals and filters transformers provides: tojson, raise_exception, namespace,
# loop controls, {% generation %}, strftime_now, tools / documents defaults, extra kwargs.
FEATURE_TEMPLATE = """{% set ns = namespace(n=0) %}
{% if messages[0]['role'] == 'system' %}SYSTEM: {{ messages[0]['content'] }}
{% endif %}
{% if tools is not none %}TOOLS: {{ tools | tojson }}
{% endif %}
{% if documents is not none %}DOCS: {{ documents | length }}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if message['role'] == 'assistant' %}
{% generation %}[{{ ns.n }}] A: {{ message['content'] | tojson }}{% endgeneration %}
    {% else %}
[{{ ns.n }}] U: {{ message['content'] }}{% if message.name is defined %} ({{ message.name }})\
{% endif %}

    {% endif %}
{% endfor %}
{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}
{% if add_generation_prompt %}A ({{ strftime_now('%Y') }}){{ eos_token }}{% endif %}"""


def _byte_level_bpe() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
    )
    return tok


def _sentencepiece_bpe() -> BackendTokenizer:
    # Llama-2's layout: spaces become "▁", unknown characters fall back to <0xNN> byte tokens.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "▁w", "ll", "▁He", "llo"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁", "w"), ("l", "l"), ("▁H", "e"), ("ll", "o")]
    tok = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


@pytest.fixture(scope="module")
def byte_level_json() -> str:
    return _byte_level_bpe().to_str()


@pytest.fixture(scope="module")
def sentencepiece_json() -> str:
    return _sentencepiece_bpe().to_str()


@pytest.fixture(scope="module")
def auto_tokenizer() -> Callable[[Path], Any]:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained


def _write_folder(
    folder: Path,
    tokenizer_json: str,
    tokenizer_config: dict[str, Any] | None = None,
    json_files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """A model folder: tokenizer.json, tokenizer_config.json if given, and `<name>.json` files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), "utf-8")
    for name, content in (json_files or {}).items():
        (folder / f"{name}.json").write_text(json.dumps(content), encoding="utf-8")
    return folder


CONFIGS = {
    "bos_eos": {"bos_token": "<s>", "eos_token": "</s>"},
    "added_token_dicts": {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False},
    },
    # transformers 5 ignores these when tokenizer.json exists: its post-processor decides.
    "add_bos_false": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False},
    "add_eos_true": {"bos_token": "<s>", "eos_token": "</s>", "add_eos_token": True},
    "new_pad_token": {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"},
    "no_config": None,
}


def _without_post_processor(tokenizer_json: str) -> str:
    data = json.loads(tokenizer_json)
    data["post_processor"] = None
    return json.dumps(data)


# --- encode / decode / special tokens ---


@pytest.mark.parametrize("post_processor", [True, False])
@pytest.mark.parametrize("config_name", CONFIGS)
def test_encode_decode_match_transformers(
    tmp_path: Path,
    byte_level_json: str,
    auto_tokenizer: Callable,
    config_name: str,
    post_processor: bool,
) -> None:
    tokenizer_json = byte_level_json if post_processor else _without_post_processor(byte_level_json)
    folder = _write_folder(tmp_path, tokenizer_json, CONFIGS[config_name])
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_bos_comes_from_the_post_processor(tmp_path: Path, byte_level_json: str) -> None:
    bos = 0  # the trainer numbers special tokens first, in order
    config = CONFIGS["add_bos_false"]
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "a", byte_level_json, config))
    ids = tok.encode("hi")
    assert ids[0] == bos and ids[1:] == tok.encode("hi", add_special_tokens=False)
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi"
    plain_json = _without_post_processor(byte_level_json)
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "b", plain_json, config))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_missing_special_token_is_added(tmp_path: Path, byte_level_json: str) -> None:
    config = CONFIGS["new_pad_token"]
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, config))
    plain_vocab = json.loads(byte_level_json)["model"]["vocab"]
    assert "<pad>" not in plain_vocab
    pad = tok.token_to_id("<pad>")
    assert pad == tok.vocab_size - 1
    assert tok.encode("a<pad>b", add_special_tokens=False)[1] == pad
    assert tok.decode([pad]) == "" and tok.id_to_token(pad) == "<pad>"


def test_legacy_special_tokens_map_matches_transformers(
    tmp_path: Path, byte_level_json: str, auto_tokenizer: Callable
) -> None:
    legacy = {"eos_token": {"content": "<|im_end|>", "lstrip": False}, "pad_token": "</s>"}
    folder = _write_folder(
        tmp_path / "legacy",
        byte_level_json,
        {"eos_token": "</s>", "chat_template": "{{ eos_token }}{{ pad_token }}"},
        {"special_tokens_map": legacy},
    )
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    assert ours.eos_token == hf.eos_token == "<|im_end|>"
    assert ours.eos_token_id == hf.eos_token_id
    expected = hf.apply_chat_template(CHAT, tokenize=False)
    assert ours.apply_chat_template(CHAT) == expected == "<|im_end|></s>"
    # With added_tokens_decoder in tokenizer_config.json, transformers skips the legacy map.
    config = {"eos_token": "</s>", "added_tokens_decoder": {}}
    folder = _write_folder(
        tmp_path / "new", byte_level_json, config, {"special_tokens_map": legacy}
    )
    assert Tokenizer.from_pretrained(folder).eos_token == auto_tokenizer(folder).eos_token == "</s>"


def test_sentencepiece_style_matches_transformers(
    tmp_path: Path, sentencepiece_json: str, auto_tokenizer: Callable
) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    folder = _write_folder(tmp_path, sentencepiece_json, config)
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    for text in ["Hello world", " Hello  world 世界", "Hewlo"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_eos_token_ids_from_generation_config(tmp_path: Path, byte_level_json: str) -> None:
    im_end = 3
    folder = _write_folder(
        tmp_path,
        byte_level_json,
        {"eos_token": "<|im_end|>"},
        {
            "generation_config": {"eos_token_id": [1, 3], "bos_token_id": 0},
            "config": {"eos_token_id": 7},  # ignored: generation_config.json decides
        },
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_id == im_end
    assert tok.eos_token_ids == (im_end, 1)  # primary first, no repeats
    assert tok.bos_token is None and tok.bos_token_id == 0


def test_eos_and_bos_fall_back_to_config_json(tmp_path: Path, byte_level_json: str) -> None:
    config = {"text_config": {"eos_token_id": [3, 1]}}  # multimodal layout
    tok = Tokenizer.from_pretrained(
        _write_folder(tmp_path, byte_level_json, None, {"config": config})
    )
    assert (tok.eos_token, tok.eos_token_id, tok.eos_token_ids) == (None, 3, (3, 1))
    assert tok.bos_token_id is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.eos_token_ids, tok.bos_token_id) == ((1,), 0)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no tokenizer\.json") as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"tokenizer_config": {"eos_token": 5}}, "eos_token .* 'content' string"),
        ({"tokenizer_config": {"pad_token": ""}}, "pad_token .* 'content' string"),
        ({"tokenizer_config": {"bos_token": {"id": 0}}}, "bos_token .* 'content' string"),
        ({"generation_config": {"eos_token_id": [1, "2"]}}, "eos_token_id .* non-negative int"),
        ({"config": {"bos_token_id": -1}}, "bos_token_id .* non-negative int"),
        ({"tokenizer_config": {"chat_template": 3}}, "chat_template .* must be a string"),
        ({"generation_config": [1]}, "must hold a JSON object"),
    ],
)
def test_bad_config_values_are_named(
    tmp_path: Path, byte_level_json: str, files: dict[str, Any], match: str
) -> None:
    _write_folder(tmp_path, byte_level_json, None, files)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_pretrained(tmp_path)


def test_config_dataclasses_validate() -> None:
    with pytest.raises(ValueError, match="generation_eos_token_ids"):
        TokenizerConfig(generation_eos_token_ids=(-1,))
    with pytest.raises(ValueError, match="eos_token must be a non-empty string"):
        SpecialTokens(eos_token="")


# --- chat templates ---


@pytest.mark.parametrize(
    "template",
    [CHATML_TEMPLATE, LLAMA3_TEMPLATE, FEATURE_TEMPLATE],
    ids=["chatml", "llama3", "features"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tmp_path: Path,
    byte_level_json: str,
    auto_tokenizer: Callable,
    template: str,
    add_generation_prompt: bool,
) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    folder = _write_folder(tmp_path, byte_level_json, config)
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(CHAT, **kwargs)
    assert text == hf.apply_chat_template(CHAT, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(CHAT, tokenize=True, **kwargs)
    assert ids == hf.apply_chat_template(CHAT, tokenize=True, return_dict=False, **kwargs)
    assert ids == ours.encode(text, add_special_tokens=False)  # no second BOS


def test_chat_template_variables_match_transformers(
    tmp_path: Path, byte_level_json: str, auto_tokenizer: Callable
) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": FEATURE_TEMPLATE}
    folder = _write_folder(tmp_path, byte_level_json, config)
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é <b>"}}}]
    messages = [
        {"role": "user", "content": "q", "name": None},  # None-valued keys are dropped
        {"role": "assistant", "content": 'a "quoted" 世界'},
        {"role": "user", "content": "q2", "name": "bob"},
    ]
    kwargs = {"tools": tools, "documents": [{"title": "t", "text": "x"}], "enable_thinking": False}
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours.apply_chat_template(messages, **kwargs) == expected
    assert '"x": "é <b>"' in expected and "(bob)" in expected and "(None)" not in expected
    # kwargs override the special tokens, as in transformers
    assert ours.apply_chat_template(messages, eos_token="<END>").endswith("<END>")
    with pytest.raises(ValueError, match="failed on these messages: bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_file_takes_precedence(
    tmp_path: Path, byte_level_json: str, auto_tokenizer: Callable
) -> None:
    config = {"bos_token": "<s>", "chat_template": "FROM CONFIG"}
    folder = _write_folder(tmp_path, byte_level_json, config)
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    assert ours.chat_template == CHATML_TEMPLATE
    text = ours.apply_chat_template(CHAT)
    assert text.startswith("<|im_start|>system\n")
    assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_list_form_chat_template_uses_default(
    tmp_path: Path, byte_level_json: str, auto_tokenizer: Callable
) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": LLAMA3_TEMPLATE},
    ]
    config = {"bos_token": "<s>", "chat_template": templates}
    folder = _write_folder(tmp_path, byte_level_json, config)
    ours, hf = Tokenizer.from_pretrained(folder), auto_tokenizer(folder)
    assert ours.chat_template == LLAMA3_TEMPLATE
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == expected


def test_missing_chat_template_is_a_clear_error(tmp_path: Path, byte_level_json: str) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "none", byte_level_json, {}))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template .*chat_template\.jinja.*tokenizer_"):
        tok.apply_chat_template(CHAT)
    # an explicit template still works
    assert tok.apply_chat_template(CHAT[:1], chat_template=CHATML_TEMPLATE).startswith("<|im_")

    config = {"chat_template": [{"name": "rag", "template": "R"}]}
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "list", byte_level_json, config))
    with pytest.raises(ValueError, match=r"lists templates \['rag'\] but none named 'default'"):
        tok.apply_chat_template(CHAT)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a list of dicts, got str"),
        ([], "at least one message"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
        ([{"content": "a"}], r"messages\[0\] must have a 'role' string"),
        ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], r"messages\[1\].*role"),
        ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no 'content'"),
    ],
)
def test_bad_messages_name_the_index(
    tmp_path: Path, byte_level_json: str, messages: Any, match: str
) -> None:
    config = {"chat_template": CHATML_TEMPLATE}
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, config))
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_invalid_template_syntax_is_a_value_error(tmp_path: Path, byte_level_json: str) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, {}))
    with pytest.raises(ValueError, match="not valid Jinja"):
        tok.apply_chat_template(CHAT, chat_template="{% for m in messages %}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
    ],
    ids=["attribute_escape", "mutation"],
)
def test_sandbox_blocks_unsafe_templates(
    tmp_path: Path, byte_level_json: str, template: str
) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, {}))
    with pytest.raises(ValueError, match="failed on these messages.*unsafe") as info:
        tok.apply_chat_template(CHAT, chat_template=template)
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


# --- streaming ---


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_holds_split_characters(
    tmp_path: Path, byte_level_json: str, chunk: int
) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, {}))
    text = "héllo 世界 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids, chunk)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.token_ids == tuple(ids)
    if chunk == 1:
        # 🙂 is 4 bytes the tiny BPE never merged: 3 held-back steps, then the whole character.
        assert ids[-4:] == tok.encode("🙂", add_special_tokens=False)
        assert deltas[-4:] == ["", "", "", "🙂"]


def test_incremental_detokenizer_drops_unfinished_character(
    tmp_path: Path, byte_level_json: str
) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, {}))
    ids = tok.encode("héllo 世界 🙂", add_special_tokens=False)[:-1]  # generation stopped mid-🙂
    assert tok.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    _stream(detok, ids)
    assert detok.text == "héllo 世界 "


def test_incremental_detokenizer_with_prompt_and_special_tokens(
    tmp_path: Path, byte_level_json: str
) -> None:
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, byte_level_json, {}))
    prompt = tok.encode("<|im_start|>user\nhé 世<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode("ça va 🙂 界</s>", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, output)
        assert detok.text == tok.decode(output, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)
    assert detok.text.endswith("界</s>")


def test_incremental_detokenizer_sentencepiece_spaces_and_byte_fallback(
    tmp_path: Path, sentencepiece_json: str
) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path, sentencepiece_json, config))
    text = "Hello world 世界 Hello"
    ids = tok.encode(text)  # <s> first; 世 and 界 are 3 <0xNN> tokens each
    assert tok.id_to_token(ids[-7]).startswith("<0x")
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # After a prompt the output's first word keeps its space, as in decode(prompt + output).
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, tok.encode(text, add_special_tokens=False))
    assert "".join(deltas) == " " + text
    assert tok.decode(prompt) + detok.text == tok.decode(prompt + tok.encode(text))


def test_specdec_tokenizer_never_imports_transformers_or_torch() -> None:
    code = (
        "import sys, specdec.tokenizer; print(sorted({'transformers', 'torch'} & set(sys.modules)))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
