"""Tokenizer of a Hugging Face model folder: encode, decode, chat templates, streaming text.

Built on `tokenizers` and `jinja2` only (never transformers or torch), yet it reproduces what
`transformers.AutoTokenizer.from_pretrained(folder)` does for the same folder:

- `tokenizer.json` holds the backend (normalizer, pre-tokenizer, model, post-processor, decoder).
- `tokenizer_config.json` names the special tokens (`bos_token`, `eos_token`, ...) and may hold
  the `chat_template`. Its `add_bos_token` / `add_eos_token` are ignored: whether encode adds BOS
  is up to tokenizer.json's post-processor, as in transformers 5 whenever tokenizer.json exists.
- `special_tokens_map.json` (legacy) overrides those special tokens when tokenizer_config.json
  has no `added_tokens_decoder`, as in transformers.
- `chat_template.jinja`, when present, overrides tokenizer_config.json's `chat_template`.
- `generation_config.json` (else `config.json`) lists the token ids that end generation.

Streaming: `IncrementalDetokenizer` turns a growing list of output token ids into text deltas and
never emits half a UTF-8 character (byte-level BPE can split one over several tokens).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "GENERATION_CONFIG_FILE",
    "IncrementalDetokenizer",
    "MODEL_CONFIG_FILE",
    "SPECIAL_TOKENS_MAP_FILE",
    "SpecialTokens",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "Tokenizer",
    "TokenizerConfig",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

# Decoded text ends with this while the last token(s) hold only part of a UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens of a tokenizer, spelled as in tokenizer_config.json.

    None means the config does not name that token. Chat templates see every named one as a
    variable of the same name (`bos_token`, `eos_token`, ...), as in transformers.
    """

    bos_token: str | None = None  # begin of sequence, e.g. "<s>", "<|begin_of_text|>"
    eos_token: str | None = None  # end of sequence (the primary one), e.g. "</s>", "<|im_end|>"
    unk_token: str | None = None  # unknown token
    sep_token: str | None = None  # separator (BERT-style models)
    pad_token: str | None = None  # padding
    cls_token: str | None = None  # classifier token (BERT-style models)
    mask_token: str | None = None  # masked-LM token

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{f.name} must be a non-empty string or None, got {value!r}.")

    def named(self) -> dict[str, str]:
        """Every set token by attribute name: {"bos_token": "<s>", "eos_token": "</s>"}."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


@dataclass(frozen=True)
class TokenizerConfig:
    """What a model folder says around tokenizer.json; see `Tokenizer.from_pretrained`."""

    special_tokens: SpecialTokens = SpecialTokens()
    # Jinja source of the chat template; None = the model has none.
    chat_template: str | None = None
    # Names of the templates tokenizer_config.json listed when none of them is "default".
    unnamed_chat_templates: tuple[str, ...] = ()
    # Token ids that end generation besides eos_token: generation_config.json's eos_token_id,
    # else config.json's, in file order.
    generation_eos_token_ids: tuple[int, ...] = ()
    # bos_token_id from generation_config.json, else config.json; used when bos_token is unset.
    generation_bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be a string or None, got {self.chat_template!r}.")
        for token_id in self.generation_eos_token_ids:
            if not _is_token_id(token_id):
                raise ValueError(
                    f"generation_eos_token_ids must hold non-negative ints, got "
                    f"{self.generation_eos_token_ids!r}."
                )
        if self.generation_bos_token_id is not None and not _is_token_id(
            self.generation_bos_token_id
        ):
            raise ValueError(
                f"generation_bos_token_id must be a non-negative int or None, got "
                f"{self.generation_bos_token_id!r}."
            )


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its model folder.

    >>> tok = Tokenizer.from_pretrained("path/to/model")       # doctest: +SKIP
    >>> messages = [{"role": "user", "content": "Hi"}]
    >>> ids = tok.apply_chat_template(messages, tokenize=True)  # doctest: +SKIP
    >>> tok.decode(ids, skip_special_tokens=False)              # doctest: +SKIP
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: TokenizerConfig | None = None,
        *,
        source: str = "<in-memory tokenizer>",
    ) -> None:
        """Takes `backend` over and changes it the way transformers does on load.

        Special tokens the config names but tokenizer.json lacks are added to the vocabulary.
        `source` names where the tokenizer came from, for error messages.
        """
        config = config if config is not None else TokenizerConfig()
        missing = [
            t for t in config.special_tokens.named().values() if backend.token_to_id(t) is None
        ]
        if missing:
            backend.add_special_tokens(
                [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
            )
        specials = config.special_tokens
        self._backend = backend
        self._config = config
        self._source = source

        bos_id = None if specials.bos_token is None else backend.token_to_id(specials.bos_token)
        self._bos_token_id = bos_id if bos_id is not None else config.generation_bos_token_id
        eos_id = None if specials.eos_token is None else backend.token_to_id(specials.eos_token)
        eos_ids = ([eos_id] if eos_id is not None else []) + list(config.generation_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))  # ordered, without repeats

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads the tokenizer of a Hugging Face model folder.

        Reads tokenizer.json (required) and, when present, tokenizer_config.json,
        chat_template.jinja, generation_config.json and config.json.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"Tokenizer folder {str(folder)!r} does not exist or is not a folder.")
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(
                f"Tokenizer folder {str(folder)!r} has no {TOKENIZER_FILE}; only fast "
                f"(tokenizers) tokenizers are supported."
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        return cls(backend, _read_config(folder), source=str(folder))

    # --- vocabulary and special tokens ---

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (do not mutate it)."""
        return self._backend

    @property
    def config(self) -> TokenizerConfig:
        return self._config

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._config.special_tokens.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._config.special_tokens.eos_token

    @property
    def bos_token_id(self) -> int | None:
        """Id of bos_token, else generation_config.json's / config.json's bos_token_id."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id: eos_token's id, else the first generation EOS id."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos_token's, then generation_config.json's (else
        config.json's), without repeats."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._config.chat_template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, equal to transformers' `tokenizer.encode(text)`."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}.")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless skip_special_tokens=False."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat ---

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: Literal[False] = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: Literal[True],
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the model's chat template (or `chat_template`).

        The text equals transformers' `apply_chat_template(messages, tokenize=False, ...)`: the
        template sees `messages`, `tools` and `documents` (None unless passed), the named special
        tokens (`bos_token`, `eos_token`, ...), `add_generation_prompt` and any `kwargs`, which
        override the special tokens. Message keys whose value is None are dropped first, as
        transformers does. With tokenize=True the text is encoded without adding special tokens,
        since the template already wrote them. Errors the template raises (raise_exception, sandbox
        violations) come back as ValueError.
        """
        template = chat_template if chat_template is not None else self._config.chat_template
        if template is None:
            raise ValueError(self._no_chat_template_message())
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self._config.special_tokens.named())
        variables.update(kwargs)
        variables["messages"] = _checked_messages(messages)
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            text = _compile_chat_template(template).render(**variables)
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...), sandbox, undefined
            raise ValueError(f"The chat template failed on these messages: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _no_chat_template_message(self) -> str:
        where = (
            f"{CHAT_TEMPLATE_FILE} and the chat_template field of {TOKENIZER_CONFIG_FILE} in "
            f"{self._source!r}"
        )
        message = f"The model has no chat template (looked up in {where})"
        if self._config.unnamed_chat_templates:
            message += (
                f"; {TOKENIZER_CONFIG_FILE} lists templates "
                f"{list(self._config.unnamed_chat_templates)} but none named 'default'"
            )
        return message + ". Pass chat_template=... or use a plain prompt."

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, "
            f"bos_token={self.bos_token!r}, eos_token_ids={self.eos_token_ids})"
        )


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, for streaming.

    Each `update` decodes a small window twice: the tokens already turned into text
    ([prefix_offset, read_offset)) and the same window plus the new tokens; the delta is what the
    second adds. When the decoded text ends in U+FFFD the last token holds only part of a UTF-8
    character, so nothing is emitted and the offsets stay put until the character completes.
    Decoding from a window rather than from token 0 keeps each update O(window), and the one
    token of context before the new ones keeps leading-space rules (SentencePiece "▁") right.

    Example with byte-level BPE, "é" = bytes C3 A9 split over two tokens:
    update([id("h")]) -> "h"; update([id(C3)]) -> "" (held back); update([id(A9)]) -> "é".
    The deltas always concatenate to `text`. Without a prompt, `text` equals
    tokenizer.decode(token_ids) minus any trailing incomplete character; with one, it is what the
    output adds to the prompt's text, so a SentencePiece tokenizer keeps the space before the
    first output word (decode(prompt + output) = decode(prompt) + text).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        prompt_context: int = 5,
    ) -> None:
        """`prompt_token_ids`' last `prompt_context` tokens give the first output tokens context."""
        if prompt_context < 0:
            raise ValueError(f"prompt_context must be >= 0, got {prompt_context}.")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_token_ids][-prompt_context:] if prompt_context else []
        self._ids: list[int] = context  # context tokens, then output tokens
        self._num_context = len(context)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are already in self._text
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        return self._text

    @property
    def token_ids(self) -> tuple[int, ...]:
        """All output token ids passed to `update` so far."""
        return tuple(self._ids[self._num_context :])

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Appends output tokens and returns the text they complete ("" while a char is split)."""
        self._ids.extend(int(t) for t in new_token_ids)
        decode = functools.partial(
            self._tokenizer.decode, skip_special_tokens=self._skip_special_tokens
        )
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta


# --- loading ---


def _read_config(folder: Path) -> TokenizerConfig:
    config_file = folder / TOKENIZER_CONFIG_FILE
    tok_config = _read_json(config_file)
    named = {f.name: (tok_config.get(f.name), config_file) for f in fields(SpecialTokens)}
    if "added_tokens_decoder" not in tok_config:  # transformers reads the legacy map only then
        map_file = folder / SPECIAL_TOKENS_MAP_FILE
        legacy = _read_json(map_file)
        named.update({k: (legacy[k], map_file) for k in named if legacy.get(k) is not None})
    specials = SpecialTokens(**{k: _token_content(v, file, k) for k, (v, file) in named.items()})
    chat_template, unnamed = _chat_template_from_config(tok_config.get("chat_template"), folder)
    template_file = folder / CHAT_TEMPLATE_FILE
    if template_file.is_file():  # chat_template.jinja wins over tokenizer_config.json, as in HF
        chat_template, unnamed = template_file.read_text(encoding="utf-8"), ()

    # generation_config.json decides the stop ids when it exists, as transformers' generate does.
    gen_file = folder / GENERATION_CONFIG_FILE
    model_file = folder / MODEL_CONFIG_FILE
    gen_config = _read_json(gen_file)
    model_config = _read_json(model_file)
    text_config = model_config.get("text_config")  # multimodal configs nest the LM's ids here
    model_sources = [(model_config, model_file)]
    if isinstance(text_config, dict):
        model_sources.append((text_config, model_file))
    sources = [(gen_config, gen_file), *model_sources]

    eos_ids: tuple[int, ...] = ()
    for source, file in sources:
        if source.get("eos_token_id") is not None:
            eos_ids = _token_ids(source["eos_token_id"], file, "eos_token_id")
            break
    bos_id = None
    for source, file in sources:
        if source.get("bos_token_id") is not None:
            bos_ids = _token_ids(source["bos_token_id"], file, "bos_token_id")
            bos_id = bos_ids[0] if bos_ids else None
            break
    return TokenizerConfig(
        special_tokens=specials,
        chat_template=chat_template,
        unnamed_chat_templates=unnamed,
        generation_eos_token_ids=eos_ids,
        generation_bos_token_id=bos_id,
    )


def _read_json(file: Path) -> dict[str, Any]:
    """The JSON object in `file`, {} when the file does not exist."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not valid JSON: {e}.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def _token_content(value: Any, file: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json spells it: "<s>" or {"content": "<s>", ...}."""
    content = value.get("content") if isinstance(value, dict) else value
    if value is None or (isinstance(content, str) and content):
        return content
    raise ValueError(
        f"{key} in {str(file)!r} must be a string or an AddedToken dict with a 'content' "
        f"string, got {value!r}."
    )


def _token_ids(value: Any, file: Path, key: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(_is_token_id(v) for v in values):
        raise ValueError(
            f"{key} in {str(file)!r} must be a non-negative int or a list of them, got {value!r}."
        )
    return tuple(values)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chat_template_from_config(value: Any, folder: Path) -> tuple[str | None, tuple[str, ...]]:
    """(template, names) from tokenizer_config.json's chat_template.

    It is a string, or a list of {"name": ..., "template": ...} from which the one named "default"
    is used; when a list has no "default", the template is None and `names` lists what it had.
    """
    if value is None or isinstance(value, str):
        return value, ()
    file = folder / TOKENIZER_CONFIG_FILE
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        templates = {t["name"]: t["template"] for t in value}
    elif isinstance(value, dict) and all(isinstance(t, str) for t in value.values()):
        templates = dict(value)
    else:
        raise ValueError(
            f"chat_template in {str(file)!r} must be a string or a list of "
            f"{{'name': str, 'template': str}} dicts, got {type(value).__name__}."
        )
    if "default" in templates:
        return templates["default"], ()
    return None, tuple(templates)


# --- chat templates ---


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages without None-valued keys; ValueError naming the first bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    if not messages:
        raise ValueError("messages must hold at least one message, got an empty list.")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        if not isinstance(message.get("role"), str):
            raise ValueError(
                f"messages[{i}] must have a 'role' string, got {message.get('role')!r}."
            )
        if "content" not in message:
            raise ValueError(f"messages[{i}] (role {message['role']!r}) has no 'content'.")
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (HF's assistant-mask marker); renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    # Chat templates come from model repos, so they run sandboxed and immutable, as in transformers.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"The chat template is not valid Jinja: {e} (line {e.lineno}).") from e
