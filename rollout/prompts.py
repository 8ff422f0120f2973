"""The prompts `run` rolls out: a user's dataset read with slime's conventions, or synthetic token ids.

A dataset is JSONL (one JSON object per line; blank lines are skipped) or Parquet (when `pyarrow` is
installed). As slime reads it: the prompt is the row's `input_key` (default `input`), plain text or a
list of chat messages; with `apply_chat_template` it goes through the model tokenizer's chat template
(`add_generation_prompt=True`, plain text becoming one user message), then the text is tokenized
without special tokens. `label_key` names the label (none by default), `metadata_key` (default
`metadata`) an optional object. Row i is group i of the run, so `run --resume` re-creates the same
group ids; the file's sha256 is recorded and a changed file is refused on resume.
A row that cannot be used stops the read with one line naming the file, the line (or row) and the cause.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from rollout.errors import CliError


@dataclass(frozen=True)
class Prompt:
    ids: list
    label: Any = None
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetKeys:
    input_key: str = "input"
    label_key: Optional[str] = None
    metadata_key: str = "metadata"
    apply_chat_template: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)


def synthetic(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Synthetic prompts: 8-24 random token ids, avoiding the first special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]


def digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rows(path: str) -> Iterator[tuple[str, Any]]:
    """(`FILE:line N` or `FILE:row N`, the row) for each row; a row that is not a JSON object is refused."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CliError(f"--prompts: {path} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise CliError(f"--prompts: {name} is Parquet but pyarrow is not installed (pip install pyarrow)") from None
        n = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                n += 1
                yield f"{name}:row {n}", row
        return
    if not path.endswith(".jsonl"):
        raise CliError(f"--prompts: {name}: expected a .jsonl or .parquet file")
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CliError(f"--prompts: {name}:line {n}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                               f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise CliError(f"--prompts: {name}:line {n}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise CliError(f"--prompts: {name}:line {n}: expected a JSON object, got {type(row).__name__}")
            yield f"{name}:line {n}", row


def _messages(value, where: str, key: str) -> list:
    ok = isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value)
    if not ok:
        raise CliError(f"--prompts: {where}: {key!r} is neither text nor a list of {{role, content}} messages")
    return value


def _text(tokenizer, value, where: str, keys: DatasetKeys) -> str:
    key = keys.input_key
    if isinstance(value, str) and not keys.apply_chat_template:
        return value
    if not keys.apply_chat_template:
        _messages(value, where, key)
        raise CliError(f"--prompts: {where}: {key!r} is a list of messages; pass --apply-chat-template")
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else _messages(value, where, key)
    if not getattr(tokenizer, "chat_template", None):
        raise CliError("--prompts: --apply-chat-template: the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **keys.chat_template_kwargs)


def load(path: str, tokenizer, keys: DatasetKeys, limit: Optional[int] = None) -> list[Prompt]:
    """The first `limit` rows (all by default) as token ids with label and metadata; `tokenizer`: the model's."""
    out = []
    for where, row in rows(path):
        if limit is not None and len(out) >= limit:
            break
        if keys.input_key not in row:
            raise CliError(f"--prompts: {where}: no key {keys.input_key!r} (--input-key)")
        if keys.label_key is not None and keys.label_key not in row:
            raise CliError(f"--prompts: {where}: no key {keys.label_key!r} (--label-key)")
        metadata = row.get(keys.metadata_key) or {}
        if not isinstance(metadata, dict):
            raise CliError(f"--prompts: {where}: {keys.metadata_key!r} must be an object, "
                           f"got {type(metadata).__name__}")
        ids = tokenizer.encode(_text(tokenizer, row[keys.input_key], where, keys), add_special_tokens=False)
        if not ids:
            raise CliError(f"--prompts: {where}: {keys.input_key!r} tokenizes to no tokens")
        out.append(Prompt(list(ids), row[keys.label_key] if keys.label_key else None, metadata))
    if not out:
        raise CliError(f"--prompts: {os.path.basename(path)} holds no rows")
    return out


def tokenizer_for(model_path: str):
    """The model's tokenizer (transformers), as slime loads it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise CliError(f"--prompts: cannot load the tokenizer of {model_path}: {why}") from None


def describe(path: Optional[str], keys: DatasetKeys) -> Optional[dict]:
    """What identifies a new run's dataset (recorded with the run for --resume); None: synthetic prompts."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise CliError(f"--prompts: {path} does not exist")
    return {"path": os.path.abspath(path), "sha256": digest(path), **asdict(keys)}


def for_run(source: Optional[dict], model_path: str, num_groups: Optional[int]) -> Optional[list]:
    """The run's first `num_groups` rows (all by default) of the dataset `describe` recorded, or None
    without one; a file changed since the run began, or too short, is refused."""
    if source is None:
        return None
    path = source["path"]
    if not os.path.isfile(path) or digest(path) != source["sha256"]:
        raise CliError(f"--prompts: {path} is missing or changed since the run began (its sha256 is recorded); "
                       f"restore it to resume")
    keys = DatasetKeys(**{k: source[k] for k in DatasetKeys.__dataclass_fields__})
    got = load(path, tokenizer_for(model_path), keys, limit=num_groups)
    if num_groups is not None and len(got) < num_groups:
        raise CliError(f"--num-groups {num_groups}: {os.path.basename(path)} holds only {len(got)} row(s)")
    return got
