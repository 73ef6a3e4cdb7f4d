"""The demo pair's data: the stdlib corpus, its held-out split, the BPE tokenizer
(stage 1 of scripts/train_demo_pair.py), packed training windows, and the run
directory's small file helpers (atomic writes, the progress log)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import sysconfig
import time
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
EOT_ID = 0  # the first special token the BPE trainer sees gets id 0

# Folders never read: tests (and their data), installed packages.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Generated or machine-specific: pydoc_data/topics.py is 750 KB of docs in a
# string; _sysconfigdata_* and config-3.x-*/ describe this build of Python.
EXCLUDED_PREFIXES = ("pydoc_data/", "_sysconfigdata_", "config-")


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


def read_corpus(s) -> tuple[Path, dict[str, str]]:
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


def stage_tokenizer(run_dir: Path, s, log: Log) -> None:
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


class Rows:
    """Fixed rows (e.g. generated sequences) in a seeded order per epoch; sample j is a
    pure function of j, like `Windows.sample`."""

    def __init__(self, rows: np.ndarray, seed: int, salt: int):
        if len(rows) == 0:
            raise ValueError("no rows to sample from.")
        self.rows, self.seed, self.salt = rows, seed, salt
        self._epoch, self._order = -1, None

    def sample(self, j: int) -> np.ndarray:
        epoch, i = divmod(j, len(self.rows))
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, self.salt, epoch]).permutation(
                len(self.rows)
            )
            self._epoch = epoch
        return self.rows[self._order[i]]


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """The first held-out windows, non-overlapping: i32[n, seq_len + 1]."""
    n = min((tokens.size - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
