"""Preference pairs for DPO-style training: rows -> tokenized pairs -> micro-batches.

[Note: preference rows]
A row is one of TRL's preference formats (``data.columns`` renames keys first):

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``: each side is
  ``BOS + prompt ids + answer ids + EOS`` (as an SFT prompt/completion, fsdpkit.data.sft:
  BOS when the tokenizer adds one, EOS once; [Note: special tokens]);
- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` lists of
  assistant messages: each side is ``prompt + side`` through the tokenizer's chat
  template, the answer being the side's assistant turns ([Note: assistant spans]);
- implicit prompt: no ``prompt``, ``chosen`` and ``rejected`` whole conversations that
  share their first messages: the shared messages are the prompt.

The loss is taken on each side's answer tokens only. A row missing a side, with an
empty answer, or with identical chosen and rejected answers is refused, naming the file
and the line / row, before any process group starts.

[Note: preference batches]
Pair ``i`` is sequences ``2i`` (chosen) and ``2i + 1`` (rejected) of one micro-batch,
each right-padded to ``data.seq_len``: a micro-batch of ``B`` pairs is an ``SFTBatch``
([Note: SFT batches]) of ``2B`` rows, no positions, no normalizer (no packing, so no
attention across sides). A side longer than ``data.seq_len + 1`` tokens keeps its first
``data.seq_len + 1`` (the answer's tail is cut) and the run's first lines count those
pairs; a side whose prompt alone fills ``data.seq_len`` has nothing left to compare and
is refused. The pairs go through the plain ``Loader`` (one "sequence" = one pair), so
the order, equal batches on every rank and the world-size independent data position are
those of every other run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fsdpkit.config import BatchSplit, DataConfig
from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.data.errors import DataError
from fsdpkit.data.loader import Loader, validation_from
from fsdpkit.data.pipeline import TrainingData
from fsdpkit.data.rows import read_rows
from fsdpkit.data.schemas import Conversation, normalize
from fsdpkit.data.sft import Example, Formatter
from fsdpkit.data.tokenizer import Tokenizer, build_tokenizer, describe_special_tokens

SIDES = ("chosen", "rejected")


def pair_of(record: Any, *, where: object) -> tuple[Conversation, Conversation]:
    """The (chosen, rejected) examples of one row ([Note: preference rows])."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a preference row must be a JSON object, not {type(record)}.")
    missing = [k for k in SIDES if k not in record or record[k] is None]
    if missing:
        keys = ", ".join(map(repr, record)) or "none"
        raise DataError(
            f"{where}: the preference row has no {' / '.join(map(repr, missing))} (keys: "
            f"{keys}); every row needs 'chosen' and 'rejected' (and 'prompt' unless both "
            "are whole conversations). Fix the row, or map columns with data.columns."
        )
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DataError(
                f"{where}: 'chosen' and 'rejected' are strings, so 'prompt' must be a string "
                f"too (got {type(prompt).__name__})."
            )
        for side, text in zip(SIDES, (chosen, rejected)):
            if not text.strip():
                raise _empty(where, side)
        if chosen == rejected:
            raise _identical(where)
        return (
            Conversation("preference", plain=(prompt, chosen)),
            Conversation("preference", plain=(prompt, rejected)),
        )
    if isinstance(chosen, list) and isinstance(rejected, list):
        return _conversational(prompt, chosen, rejected, where=where)
    raise DataError(
        f"{where}: 'chosen' and 'rejected' must both be strings or both message lists; got "
        f"{type(chosen).__name__} and {type(rejected).__name__}."
    )


def _conversational(
    prompt: Any, chosen: list[Any], rejected: list[Any], *, where: object
) -> tuple[Conversation, Conversation]:
    sides = [normalize(x, where, key=k) for k, x in zip(SIDES, (chosen, rejected))]
    if prompt is None:  # implicit prompt: the messages both conversations share
        shared = 0
        while shared < min(map(len, sides)) and sides[0][shared] == sides[1][shared]:
            shared += 1
        head, sides = sides[0][:shared], [s[shared:] for s in sides]
    else:
        head = normalize(prompt, where, key="prompt")
    for side, messages in zip(SIDES, sides):
        replies = [m for m in messages if m["role"] == "assistant"]
        if not replies or not all(m["content"].strip() or m.get("tool_calls") for m in replies):
            raise _empty(where, side)
    if sides[0] == sides[1]:
        raise _identical(where)
    convs = [Conversation("preference", head + s, train_from=len(head)) for s in sides]
    return convs[0], convs[1]


def _empty(where: object, side: str) -> DataError:
    return DataError(
        f"{where}: the {side!r} answer is empty, so the pair compares nothing (the loss is "
        "taken on the answers only). Fill it in or remove the row."
    )


def _identical(where: object) -> DataError:
    return DataError(
        f"{where}: 'chosen' and 'rejected' are identical, so the pair has no preference to "
        "learn (its loss is constant). Remove the row or fix one side."
    )


def read_pairs(cfg: DataConfig) -> list[tuple[Conversation, Conversation, str]]:
    """Every row of ``data.path`` as (chosen, rejected, where), checked, in file order,
    through the readers every other run uses (jsonl, json, parquet, Arrow)."""
    out = []
    rows = read_rows(
        cfg, what="preference pairs", objective="dpo", keys="prompt / chosen / rejected"
    )
    for record, where in rows:
        chosen, rejected = pair_of(record, where=where)
        out.append((chosen, rejected, where))
    if not out:
        raise DataError(f"data.path ({cfg.path}) holds no preference rows.")
    return out


class Pairs:
    """Tokenized pairs as the loader's table of sequences (``len`` = pairs); each side
    is cut to ``seq_len + 1`` tokens ([Note: preference batches])."""

    def __init__(self, examples: list[Example], *, seq_len: int, pad_id: int) -> None:
        self.seq_len, self.pad_id = seq_len, pad_id
        self.lengths = np.asarray([min(len(ex.ids), seq_len + 1) for ex in examples], np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.ids = np.concatenate([ex.ids[: seq_len + 1] for ex in examples]).astype(np.int32)
        self.train = np.concatenate([ex.train[: seq_len + 1] for ex in examples])

    def __len__(self) -> int:
        return len(self.lengths) // 2

    def side(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, answer mask) of sequence ``seq`` (2i chosen, 2i + 1 rejected)."""
        lo = int(self.starts[seq])
        hi = lo + int(self.lengths[seq])
        return self.ids[lo:hi], self.train[lo:hi]

    def take(self, ids: np.ndarray, *, normalizer: float | None = None) -> SFTBatch:
        del normalizer  # every pair weighs the same: the loss is a mean over pairs
        pairs = np.asarray(ids, dtype=np.int64)
        rows = np.stack([2 * pairs, 2 * pairs + 1], 1).ravel()
        inputs = torch.full((len(rows), self.seq_len), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(rows), self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        for r, seq in enumerate(rows):
            tokens, train = self.side(int(seq))
            n = len(tokens) - 1
            inputs[r, :n] = torch.from_numpy(tokens[:-1].astype(np.int64))
            targets[r, :n] = torch.from_numpy(np.where(train[1:], tokens[1:], IGNORE_INDEX))
        return SFTBatch(inputs, targets)

    def targets_in(self, ids: np.ndarray) -> int:
        return sum(int(self.side(2 * int(i) + k)[1][1:].sum()) for i in ids for k in (0, 1))

    def too_small(self, *, world: int, batch: int) -> DataError:
        return DataError(
            f"The preference data has {len(self)} training pairs (after data.val_fraction), "
            f"but one step across {world} data-parallel rank(s) x {batch} pairs per rank "
            "needs more. Use more rows, or a smaller train.global_batch_size / "
            "train.micro_batch_size x train.grad_accum."
        )


@dataclass(frozen=True)
class PreferenceData:
    """Every pair of ``data.path``, tokenized and checked (in memory)."""

    train: Pairs
    val: Pairs | None
    truncated: int
    """Pairs with a side longer than data.seq_len + 1 tokens (their tails cut)."""
    formats: Counter[str]
    specials: str = ""
    """``describe_special_tokens`` of the tokenizer the pairs were made with."""

    def describe(self, cfg: DataConfig) -> str:
        kinds = ", ".join(f"{k} ({n:,} rows)" for k, n in sorted(self.formats.items()))
        text = f"preference data ({kinds}): {len(self.train):,} training pairs"
        if self.val is not None:
            text += f", {len(self.val):,} validation pairs"
        if self.truncated:
            text += (
                f"; {self.truncated:,} pairs have a side longer than data.seq_len + 1 = "
                f"{cfg.seq_len + 1} tokens: their answers' tails are cut"
            )
        text += "; loss on the answer tokens only"
        return text + (f"\ndata: {self.specials}" if self.specials else "")


def load_pairs(cfg: DataConfig, tokenizer: Tokenizer) -> PreferenceData:
    """Read, check and tokenize every pair; the last ``data.val_fraction`` are held out."""
    rows = read_pairs(cfg)
    formatter = Formatter(
        tokenizer=tokenizer, tokenizer_path=cfg.tokenizer, data_path=cfg.path or ""
    )
    formats: Counter[str] = Counter()
    examples: list[Example] = []
    truncated = 0
    for chosen, rejected, where in rows:
        formats["conversational" if chosen.messages else "standard"] += 1
        pair = formatter.examples([chosen, rejected], [where, where])
        long = False
        for side, ex in zip(SIDES, pair):
            long |= len(ex.ids) > cfg.seq_len + 1
            if not ex.train[1 : cfg.seq_len + 1].any():
                raise DataError(
                    f"{where}: the {side!r} side's prompt fills all of data.seq_len "
                    f"({cfg.seq_len}) tokens, so none of its answer is left to compare. "
                    "Raise data.seq_len or shorten the prompt."
                )
        truncated += long
        examples += pair
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    n_val = int(len(rows) * cfg.val_fraction)
    cut = 2 * (len(rows) - n_val)
    train = Pairs(examples[:cut], seq_len=cfg.seq_len, pad_id=pad)
    val = Pairs(examples[cut:], seq_len=cfg.seq_len, pad_id=pad) if n_val else None
    specials = describe_special_tokens(tokenizer, rows=True, chat=formats["conversational"] > 0)
    return PreferenceData(train, val, truncated, formats, specials)


def open_preference_data(
    cfg: DataConfig, *, split: BatchSplit, dp_rank: int, dp_world: int, **opts: int
) -> TrainingData:
    """``open_training_data`` for ``train.objective = dpo``: this rank's pair batches
    (``split.micro_batch`` pairs each) with the plain loader's order and position;
    ``opts``: ``seed`` and ``eval_batches``."""
    tokenizer = build_tokenizer(cfg)
    data = load_pairs(cfg, tokenizer)
    micro_batch = split.micro_batch
    ranks: dict[str, Any] = {"dp_rank": dp_rank, "dp_world": dp_world}
    loader = Loader(
        data.train,
        micro_batch_size=micro_batch,
        seed=opts["seed"],
        grad_accum=split.grad_accum,
        **ranks,
    )
    val = []
    if data.val is not None and len(data.val) >= dp_world * micro_batch:
        val = validation_from(
            data.val, micro_batch_size=micro_batch, max_batches=opts["eval_batches"], **ranks
        )
    record = {
        "preference_pairs": len(data.train),
        "truncated_pairs": data.truncated,
        "train_sequences": len(data.train),
        "steps_per_epoch": loader.steps_per_epoch,
    }
    return TrainingData(tokenizer, loader, val, False, data.describe(cfg), record=record)
