"""Supervised fine-tuning examples: normalized records -> token ids and a loss mask.

A string prompt/completion (TRL standard, or alpaca without a chat template) becomes
``BOS + prompt ids + completion ids + EOS``: BOS when the tokenizer's own encode adds one,
EOS (its end-of-sequence token, when it has one) unless the completion already ends with
it ([Note: special tokens] in fsdpkit.data.tokenizer); the prompt and the completion are
tokenized separately, so the answer starts exactly at the completion's first character.
The loss is on the completion and the EOS.
A conversation (messages, ShareGPT, TRL conversational, alpaca with a template) is
formatted with the tokenizer's chat template, with the loss on the assistant turns
([Note: assistant spans] in fsdpkit.data.chat). The first token of an example is never
a target ([Note: SFT batches]). Which records are which: [Note: SFT schemas].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdpkit.config import DataConfig
from fsdpkit.data.chat import ChatTemplate
from fsdpkit.data.plan import data_kind
from fsdpkit.data.schemas import LABELS, Conversation
from fsdpkit.data.tokenizer import Tokenizer, with_bos, with_eos


@dataclass(frozen=True)
class Example:
    """One tokenized example."""

    ids: np.ndarray
    """int64 token ids."""
    train: np.ndarray
    """bool per token: it is an answer token (predicting it counts in the loss)."""


@dataclass(frozen=True)
class Block:
    """Examples back to back, as a shard stores them."""

    ids: np.ndarray
    """int64 token ids of every example, concatenated."""
    train: np.ndarray
    """bool per token: an answer token."""
    lengths: np.ndarray
    """int64 tokens of each example."""

    @classmethod
    def of(cls, examples: list[Example]) -> Block:
        if not examples:
            return cls(np.empty(0, np.int64), np.empty(0, bool), np.empty(0, np.int64))
        return cls(
            np.concatenate([ex.ids for ex in examples]),
            np.concatenate([ex.train for ex in examples]),
            np.asarray([len(ex.ids) for ex in examples], dtype=np.int64),
        )

    def answers(self) -> np.ndarray:
        """Answer tokens of each example."""
        counts = np.concatenate([[0], np.cumsum(self.train, dtype=np.int64)])
        ends = np.cumsum(self.lengths)
        return counts[ends] - counts[ends - self.lengths]


class Formatter:
    """Conversations -> examples: strings with the run's tokenizer (batched), chat with
    the tokenizer's template (loaded at the first conversation that needs it)."""

    def __init__(self, *, tokenizer: Tokenizer, tokenizer_path: str | None, data_path: str):
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.data_path = data_path
        self._chat: ChatTemplate | None = None
        self._looked = False

    def _template(self, *, required: bool) -> ChatTemplate | None:
        if self._chat is None and (required or not self._looked):
            self._looked = True
            find = ChatTemplate.load if required else ChatTemplate.find
            self._chat = find(self.tokenizer_path, data_path=self.data_path)
        return self._chat

    def examples(self, convs: list[Conversation], wheres: list[object]) -> list[Example]:
        """The examples of ``convs``, in order; plain ones encoded in one batch call."""
        out: list[Example | None] = [None] * len(convs)
        plain: list[int] = []
        for i, conv in enumerate(convs):
            chat = None
            if conv.messages:
                chat = self._template(required=conv.plain is None)
            if chat is None:
                plain.append(i)
                continue
            ids, train = chat.encode(
                conv.messages,
                where=wheres[i],
                train_from=conv.train_from,
                tools=conv.tools,
                untrained=conv.untrained,
            )
            out[i] = _example(ids, train)
        if plain:
            for i, ex in zip(plain, self._plain([convs[i] for i in plain])):
                out[i] = ex
        return [ex for ex in out if ex is not None]

    def block(self, convs: list[Conversation], wheres: list[object]) -> Block:
        """``examples`` back to back; string prompt/completion batches (the common case
        at scale) are laid out with whole-array operations, not one array per row."""
        chat = any(c.messages and self._template(required=c.plain is None) for c in convs)
        if chat or not convs:
            return Block.of(self.examples(convs, wheres))
        prompts, answers = self._strings(convs)
        prompt = np.asarray([len(p) for p in prompts], dtype=np.int64)
        answer = np.asarray([len(a) for a in answers], dtype=np.int64)
        pieces = [x for p, a in zip(prompts, answers) for x in (p, a)]
        lengths = prompt + answer
        train = np.repeat(np.tile([False, True], len(convs)), np.stack([prompt, answer], 1).ravel())
        starts = np.cumsum(lengths) - lengths
        train[starts[lengths > 0]] = False  # the first token is predicted from nothing
        return Block(np.concatenate(pieces).astype(np.int64), train, lengths)

    def _strings(self, convs: list[Conversation]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(prompt ids with BOS, completion ids with EOS) of string rows, encoded in one
        batch call ([Note: special tokens])."""
        texts = [part for conv in convs if conv.plain for part in conv.plain]
        encoded = _encode_many(self.tokenizer, texts)
        prompts = [with_bos(self.tokenizer, p.astype(np.int64)) for p in encoded[0::2]]
        answers = [with_eos(self.tokenizer, a.astype(np.int64)) for a in encoded[1::2]]
        return prompts, answers

    def _plain(self, convs: list[Conversation]) -> list[Example]:
        out = []
        for prompt, answer in zip(*self._strings(convs)):
            ids = np.concatenate([prompt, answer])
            train = np.zeros(len(ids), dtype=bool)
            train[len(prompt) :] = True
            out.append(_example(ids, train))
        return out


def _encode_many(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    many = getattr(tokenizer, "encode_many", None)
    if many is not None:
        return list(many(texts))
    return [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]


def _example(ids: np.ndarray, train: np.ndarray) -> Example:
    train = train.copy()
    train[:1] = False  # the first token is predicted from nothing of its own
    return Example(ids=np.asarray(ids, dtype=np.int64), train=train)


def describe_schemas(schemas: dict[str, int]) -> str:
    """``"ShareGPT conversations (12,000 rows), prompt/completion (3 rows)"``."""
    parts = [f"{LABELS.get(k, k)} ({n:,} rows)" for k, n in sorted(schemas.items())]
    return ", ".join(parts) or "no rows"


def is_sft(cfg: DataConfig) -> bool:
    """Whether the run trains on SFT rows (``data.format``, ``data.schema``, or what the
    first record of ``data.path`` looks like)."""
    return data_kind(cfg) == "sft"
