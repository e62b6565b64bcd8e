"""Chat conversations formatted with the tokenizer's own chat template.

[Note: assistant spans]
The text a conversation trains on is exactly ``tokenizer.apply_chat_template(messages,
tokenize=False)`` and its ids are that text tokenized without added special tokens (what
``apply_chat_template(messages, tokenize=True)`` returns). The loss covers the assistant
turns only. Templates rarely mark them (``{% generation %}`` is rare), so the span of
assistant message ``i`` is found by rendering prefixes: ``render(messages[:i],
add_generation_prompt=True)`` ends where the reply starts and ``render(messages[:i+1])``
ends where it ends (its end-of-turn tokens included, so the model learns to stop). Both
must be prefixes of the whole rendering; a template that renders earlier turns
differently once later ones exist (some drop past reasoning) is refused with a clear
error. A token is an answer token when its first character lies in an assistant span
(character offsets from the fast tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.data.errors import DataError

TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
"""Where a tokenizer directory carries its chat template (``chat_template`` key of
tokenizer_config.json, or the files transformers 5 writes)."""


def tokenizer_dir(tokenizer: str | None) -> Path | None:
    """The directory of ``data.tokenizer`` (a tokenizer.json's folder, or the folder)."""
    if not tokenizer:
        return None
    path = Path(tokenizer).expanduser()
    return path.parent if path.is_file() else path


class ChatTemplate:
    """A tokenizer directory's chat template and fast tokenizer (transformers)."""

    def __init__(self, tokenizer: Any, *, source: Path) -> None:
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def load(cls, tokenizer: str | None, *, data_path: str) -> ChatTemplate:
        """The template of ``data.tokenizer``; a DataError when there is none."""
        folder = tokenizer_dir(tokenizer)
        if folder is None:
            raise _no_template(data_path, "data.tokenizer is empty (the byte-level tokenizer)")
        tok = _auto_tokenizer(folder, data_path=data_path)
        if not getattr(tok, "chat_template", None):
            raise _no_template(data_path, f"the tokenizer in {folder} has no chat template")
        if not getattr(tok, "is_fast", False):
            raise DataError(
                f"the tokenizer in {folder} is a slow (Python) tokenizer; fsdpkit needs a "
                "fast one (tokenizer.json) to find the assistant tokens. Save it with "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)."
            )
        return cls(tok, source=folder)

    @classmethod
    def find(cls, tokenizer: str | None, *, data_path: str) -> ChatTemplate | None:
        """The template of ``data.tokenizer`` when it has one, else None (alpaca rows
        then use the plain Alpaca prompt)."""
        folder = tokenizer_dir(tokenizer)
        if folder is None or not has_template(folder):
            return None
        return cls.load(tokenizer, data_path=data_path)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool = False,
        tools: list[Any] | None = None,
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)

    def encode(
        self,
        messages: list[dict[str, Any]],
        *,
        where: object,
        train_from: int = 0,
        tools: list[Any] | None = None,
        untrained: tuple[int, ...] = (),
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, answer-token mask) of one conversation ([Note: assistant spans]); only
        assistant messages from index ``train_from`` on, and not in ``untrained``, are
        trained."""
        text = self.render(messages, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < train_from or i in untrained:
                continue
            start = self.render(messages[:i], generation_prompt=True, tools=tools) if i else ""
            upto = self.render(messages[: i + 1], tools=tools)
            if not (upto.startswith(start) and text.startswith(upto)):
                raise DataError(
                    f"{where}: the chat template of {self.source} renders the beginning of "
                    "this conversation differently once later turns are added, so the "
                    "assistant replies cannot be located in the text (see docs/finetune.md). "
                    "Use prompt/completion rows, or a template that renders turns "
                    "independently."
                )
            spans.append((len(start), len(upto)))
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        train = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            train |= (starts >= lo) & (starts < hi)
        return ids, train


def has_template(folder: Path) -> bool:
    """Whether a tokenizer directory carries a chat template (without loading it)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def template_hash(tokenizer: str | None) -> str | None:
    """sha256 of the chat template files of ``data.tokenizer`` (None: no template), so a
    prepared SFT dataset knows which template rendered it."""
    folder = tokenizer_dir(tokenizer)
    if folder is None or not has_template(folder):
        return None
    digest = hashlib.sha256()
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return "sha256:" + digest.hexdigest()


def _auto_tokenizer(folder: Path, *, data_path: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise DataError(
            f"{data_path} holds chat conversations, which are formatted with the "
            "tokenizer's chat template: that needs `transformers` (pip install "
            "'fsdpkit[hf]')."
        ) from None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise _no_template(
            data_path, f"{folder} could not be loaded by AutoTokenizer ({exc})"
        ) from None


def _no_template(data_path: str, why: str) -> DataError:
    return DataError(
        f"{data_path} holds chat conversations (messages / ShareGPT rows), which fsdpkit formats "
        f"with the tokenizer's chat template, but {why}. Point data.tokenizer (or model.hf) "
        "at a tokenizer directory whose tokenizer_config.json has a 'chat_template' (or that "
        "holds chat_template.jinja), or rewrite the rows as prompt/completion pairs, which "
        "need no template."
    )
