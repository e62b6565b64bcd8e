"""Supervised fine-tuning data: ``.jsonl`` rows of prompt/completion or chat messages.

Each row is one example, either

    {"prompt": "What is 2+2?", "completion": " 4"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

(a file may mix both). A prompt/completion row becomes ``prompt ids + completion ids +
EOS`` (the tokenizer's end-of-sequence token when it has one; no BOS is added, as for
plain text), with the loss on the completion and the EOS. A chat row is formatted with
the tokenizer's chat template, with the loss on the assistant turns ([Note: assistant
spans] in fsdpkit.data.chat). The first token of an example is never a target
([Note: SFT batches]). Every row is checked before training: an unknown role, an empty
completion or assistant reply, a missing field is an error naming the file and line.

``data.format = auto`` treats a ``.jsonl`` source as SFT when its first row has
``messages`` or ``prompt``/``completion`` and no ``data.text_field``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.config import DataConfig
from fsdpkit.data.chat import ChatTemplate
from fsdpkit.data.corpus import resolve_files
from fsdpkit.data.errors import DataError
from fsdpkit.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
"""Roles a chat message may have."""


@dataclass(frozen=True)
class Example:
    """One tokenized example."""

    ids: np.ndarray
    """int64 token ids."""
    train: np.ndarray
    """bool per token: it is an answer token (predicting it counts in the loss)."""


@dataclass
class ReadStats:
    """What reading the SFT source found (reported at the start of the run)."""

    prompt_completion: int = 0
    chat: int = 0
    files: int = 0
    stopped_at_max_bytes: bool = False
    sources: list[str] = field(default_factory=list)


def _first_record(file: Path) -> Any:
    try:
        with file.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    return json.loads(line)
    except (OSError, ValueError):
        return None
    return None


def is_sft(cfg: DataConfig) -> bool:
    """Whether the run trains on SFT rows (``data.format``, or its auto-detection)."""
    if cfg.format != "auto":
        return cfg.format == "sft"
    if not cfg.path:
        return False
    files = resolve_files(cfg.path)
    if not files or files[0].suffix != ".jsonl":
        return False
    record = _first_record(files[0])
    if not isinstance(record, dict) or cfg.text_field in record:
        return False
    return "messages" in record or ("prompt" in record and "completion" in record)


def _records(cfg: DataConfig, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed row) of every non-empty line, at most data.max_bytes."""
    budget = cfg.max_bytes
    assert cfg.path is not None
    for file in resolve_files(cfg.path):
        if file.suffix != ".jsonl":
            raise DataError(
                f"data.path: {file} is not a .jsonl file; SFT data is one JSON object per "
                "line in .jsonl files (prompt/completion or messages)."
            )
        stats.files += 1
        try:
            with file.open(encoding="utf-8", errors="replace") as f:
                for line_no, line in enumerate(f, start=1):
                    budget -= len(line.encode("utf-8"))
                    if budget < 0:
                        stats.stopped_at_max_bytes = True
                        return
                    if line.strip():
                        yield f"{file}:{line_no}", _parse(line, f"{file}:{line_no}")
        except OSError as exc:
            raise DataError(f"data.path: cannot read {file} ({exc.strerror or exc}).") from exc


def _parse(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: not valid JSON ({exc.msg}). A .jsonl file holds one JSON object per "
            "line; fix or remove that line."
        ) from exc


def check_row(record: Any, where: str) -> str:
    """``"chat"`` or ``"prompt"`` for a valid row; a DataError naming the problem."""
    if isinstance(record, dict) and "messages" in record:
        _check_messages(record["messages"], where)
        return "chat"
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(
                f"{where}: 'prompt' and 'completion' must be strings (got "
                f"{type(prompt).__name__} and {type(completion).__name__}). For "
                "conversations use a 'messages' list instead."
            )
        if not completion.strip():
            raise DataError(
                f"{where}: the completion is empty, so this example has nothing to learn "
                "(the loss is taken on the completion only). Fill it in or remove the line."
            )
        return "prompt"
    present = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    raise DataError(
        f"{where}: an SFT row needs 'prompt' and 'completion' strings, or a 'messages' list "
        f"of {{'role', 'content'}} objects; this row has {present}. Fix the line, or set "
        "data.format=text to train on plain text (data.text_field)."
    )


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}.")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise DataError(
                f"{where}: message {i} has role {role!r}; SFT conversations use the roles "
                f"{', '.join(ROLES)}. Rename the role (e.g. 'human' -> 'user', 'gpt' -> "
                "'assistant') or drop the message."
            )
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} ({role}) has no string 'content'.")
    replies = [m for m in messages if m["role"] == "assistant"]
    if not replies or not all(m["content"].strip() for m in replies):
        raise DataError(
            f"{where}: the conversation has no assistant message, or an empty one, so it "
            "has nothing to learn (the loss is taken on assistant replies only). Add the "
            "reply or remove the line."
        )


class Formatter:
    """Rows -> examples: prompt/completion with the run's tokenizer, chat with the
    tokenizer's template (loaded at the first chat row)."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._chat: ChatTemplate | None = None

    def example(self, record: dict[str, Any], kind: str, where: str) -> Example:
        if kind == "chat":
            if self._chat is None:
                self._chat = ChatTemplate.load(self.cfg.tokenizer, data_path=str(self.cfg.path))
            ids, train = self._chat.encode(record["messages"], where=where)
        else:
            prompt = self.tokenizer.encode(record["prompt"])
            answer = self.tokenizer.encode(record["completion"])
            eos = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
            ids = np.asarray(prompt + answer + eos, dtype=np.int64)
            train = np.zeros(len(ids), dtype=bool)
            train[len(prompt) :] = True
        train[:1] = False  # the first token is predicted from nothing of its own
        return Example(ids=ids, train=train)


def load_examples(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[list[Example], ReadStats]:
    """Every row of ``data.path`` checked and tokenized, in file order."""
    stats = ReadStats()
    formatter = Formatter(cfg, tokenizer)
    examples = []
    for where, record in _records(cfg, stats):
        kind = check_row(record, where)
        if kind == "chat":
            stats.chat += 1
        else:
            stats.prompt_completion += 1
        examples.append(formatter.example(record, kind, where))
    if not examples:
        raise DataError(
            f"data.path ({cfg.path}) holds no SFT rows (or data.max_bytes = {cfg.max_bytes} "
            "stops before the first one)."
        )
    return examples, stats
