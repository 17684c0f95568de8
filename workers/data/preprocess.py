"""`raytron preprocess`: tokenise JSONL or text into Megatron's indexed dataset.

The same output as Megatron-LM's ``tools/preprocess_data.py`` with a Hugging Face tokenizer:
for each JSON key ``K`` a pair ``{output_prefix}_{K}_document.bin/.idx`` whose token dtype is
``DType.optimal_dtype(vocab_size)``, one document per input line. As Megatron's ``Encoder``:
a text is tokenised with the tokenizer's special tokens (its post-processor, e.g. a BOS) unless
``include_special_tokens=False``; a value that is a list is a document of several sentences
(one sequence each, empty ones dropped); ``append_eod`` adds the tokenizer's EOS id to the end
of a non-empty document. Plain text input (any suffix but ``.json``/``.jsonl``) is one document
per line under the key ``text``. Blank lines are skipped.

Nothing here prints; progress goes to a callback. Tokenizers load from local files only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from workers.data.indexed import IndexedDatasetWriter, optimal_dtype

ProgressFn = Callable[[int, int], None]
"""Called with (bytes read, total bytes) as the input is consumed."""

_BATCH_DOCS = 512


@dataclass
class PreprocessResult:
    """What :func:`preprocess` wrote: per JSON key, the prefix to use as ``training.data``."""

    outputs: dict[str, str]
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    dtype: str = ""
    vocab_size: int = 0


class HFTokenizer:
    """A local Hugging Face tokenizer: ``tokenizer.json`` (``tokenizers``) or a directory.

    Args:
        path: a tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) or a
            ``tokenizer.json`` file. A directory without ``tokenizer.json`` needs ``transformers``.
        eod_token: the end-of-document token; default the tokenizer's ``eos_token``.
        include_special_tokens: add the tokenizer's special tokens to each text (Megatron's default).

    Raises:
        ValueError: the path does not exist or holds no tokenizer, or a library is missing.
    """

    def __init__(self, path: str, eod_token: str | None = None, include_special_tokens: bool = True):
        p = Path(path)
        if not p.exists():
            raise ValueError(f"tokenizer {path!r} does not exist; give a local Hugging Face tokenizer directory "
                             f"or tokenizer.json (nothing is downloaded)")
        self.include_special_tokens = include_special_tokens
        file = p / "tokenizer.json" if p.is_dir() else p
        config_dir = p if p.is_dir() else p.parent
        if file.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ValueError("reading a tokenizer needs the `tokenizers` package: "
                                 "pip install 'raytron[data]'") from None
            try:
                self._fast = Tokenizer.from_file(str(file))
            except Exception as e:  # the library raises its own exception types
                raise ValueError(f"{file} is not a Hugging Face tokenizer.json: {e}") from None
            self._auto = None
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            self._fast, self._auto = None, _auto_tokenizer(p)
            self.vocab_size = len(self._auto)
        self.eod = self._eod_id(eod_token, config_dir)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=self.include_special_tokens)]
        return self._auto(texts, add_special_tokens=self.include_special_tokens)["input_ids"]

    def _token_id(self, token: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(token)
        tid = self._auto.convert_tokens_to_ids(token)
        return None if tid == self._auto.unk_token_id and token != self._auto.unk_token else tid

    def _eod_id(self, eod_token: str | None, config_dir: Path) -> int | None:
        if eod_token is not None:
            tid = self._token_id(eod_token)
            if tid is None:
                raise ValueError(f"eod token {eod_token!r} is not in the tokenizer's vocabulary")
            return tid
        if self._auto is not None and self._auto.eos_token_id is not None:
            return self._auto.eos_token_id
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            eos = _read_json(config_dir / name).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and self._token_id(eos) is not None:
                return self._token_id(eos)
        return None  # as Megatron: no eos_token, no EOD (a bare tokenizer.json names none)


def _auto_tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{path} has no tokenizer.json; reading it needs transformers: "
                         f"pip install 'raytron[data]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/... for a bad directory
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _documents(input_path: str, json_keys: tuple[str, ...], jsonl: bool):
    """Yield (bytes consumed so far, {key: list of texts}) per document line."""
    done = 0
    with open(input_path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{input_path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            if not jsonl:
                yield done, {"text": [line.rstrip("\r\n")]}
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{input_path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{input_path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            doc = {}
            for key in json_keys:
                if key not in obj:
                    raise ValueError(f"{input_path}:{lineno}: no key {key!r} (the line has {sorted(obj)}); "
                                     f"choose the keys with --json-keys")
                value = obj[key]
                sentences = value if isinstance(value, list) else [value]
                if not all(isinstance(s, str) for s in sentences):
                    raise ValueError(f"{input_path}:{lineno}: key {key!r} holds {type(value).__name__}, "
                                     f"expected a string or a list of strings")
                doc[key] = sentences
            yield done, doc


def preprocess(input_path: str, tokenizer: str | HFTokenizer, output_prefix: str, *,
               json_keys: tuple[str, ...] | list[str] = ("text",), append_eod: bool = False,
               input_format: str = "auto", progress: ProgressFn | None = None) -> PreprocessResult:
    """Tokenise ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx`` per JSON key.

    Args:
        input_path: JSONL (one object per line) or plain text (one document per line).
        tokenizer: a tokenizer path (see :class:`HFTokenizer`) or a loaded one.
        output_prefix: where to write; directories are created.
        json_keys: the JSON keys to tokenise, one dataset each (Megatron's ``--json-keys``).
        append_eod: end each document with the tokenizer's EOS id (Megatron's ``--append-eod``).
        input_format: ``"jsonl"``, ``"text"``, or ``"auto"`` (``.json``/``.jsonl`` are JSONL).
        progress: called with (bytes read, total bytes).

    Returns:
        The output prefixes and counts.

    Raises:
        ValueError: a missing input, a bad line (with its number), a missing key, a tokenizer
            without an EOS token while ``append_eod`` is set.
    """
    if not os.path.isfile(input_path):
        raise ValueError(f"input {input_path!r} does not exist or is not a file")
    if input_format not in ("auto", "jsonl", "text"):
        raise ValueError(f"input format {input_format!r}: use auto, jsonl or text")
    jsonl = input_format == "jsonl" or (input_format == "auto" and Path(input_path).suffix.lower() in (".json", ".jsonl"))
    json_keys = tuple(json_keys)
    if not json_keys:
        raise ValueError("--json-keys needs at least one key")
    if not jsonl and json_keys != ("text",):
        raise ValueError(f"--json-keys {' '.join(json_keys)} applies to JSONL input; {input_path} is read as plain "
                         f"text (one document per line); name it .jsonl or pass --input-format jsonl")
    tok = tokenizer if isinstance(tokenizer, HFTokenizer) else HFTokenizer(tokenizer)
    if append_eod and tok.eod is None:
        raise ValueError("--append-eod: the tokenizer has no eos_token; name one with --eod-token")
    dtype = optimal_dtype(tok.vocab_size)
    outputs = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    result = PreprocessResult(outputs=outputs, tokens=dict.fromkeys(json_keys, 0), dtype=dtype.__name__,
                              vocab_size=tok.vocab_size)
    total = os.path.getsize(input_path)
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in outputs.items()}
    try:
        batch: list[dict] = []
        done = 0
        for done, doc in _documents(input_path, json_keys, jsonl):
            batch.append(doc)
            if len(batch) == _BATCH_DOCS:
                _write_batch(batch, tok, writers, result, append_eod)
                batch = []
                if progress:
                    progress(done, total)
        _write_batch(batch, tok, writers, result, append_eod)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.finalize()
    if progress:
        progress(total, total)
    return result


def _write_batch(batch: list[dict], tok: HFTokenizer, writers: dict, result: PreprocessResult,
                 append_eod: bool) -> None:
    """Megatron's ``Encoder.encode`` + ``add_document`` for a batch of documents."""
    for key, writer in writers.items():
        texts = [s for doc in batch for s in doc[key]]
        encoded = iter(tok.encode_batch(texts)) if texts else iter(())
        for doc in batch:
            ids: list[int] = []
            lengths: list[int] = []
            for _ in doc[key]:
                sentence = next(encoded)
                if sentence:
                    ids.extend(sentence)
                    lengths.append(len(sentence))
            if ids and append_eod:
                ids.append(tok.eod)
                lengths[-1] += 1
            writer.add_document(ids, lengths)
            result.tokens[key] += len(ids)
    result.documents += len(batch)
