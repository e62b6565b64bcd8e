"""Prompt rows for online RL (``train.objective = grpo``): rows -> checked, tokenized prompts.

[Note: prompt rows]
A row is TRL's prompt-only format (``data.columns`` renames keys first):

- ``prompt`` a string (standard): the model continues the string itself; its ids are
  the run's tokenizer's ``encode`` of it with the tokenizer's BOS first where its own
  encode adds one ([Note: special tokens] in fsdpkit.data.tokenizer), as TRL 1.16's
  ``processing_class(text=prompts)`` gives them;
- ``prompt`` a list of ``{"role", "content"}`` messages (conversational): the text is
  the tokenizer's chat template rendered with ``add_generation_prompt=True`` and its ids
  that text tokenized without added special tokens: exactly TRL 1.16's
  ``apply_chat_template(prompts, add_generation_prompt=True, tokenize=True)``.

Every other column is kept and handed to the reward functions by name, as TRL passes
every column (``answer``, ``solution``, ``ground_truth``, anything else); verl's nested
``reward_model: {"ground_truth": ...}`` is also offered as ``ground_truth``. Rewards
receive the prompt as the data has it (string or messages). A row without ``prompt``,
with an empty prompt, with a column named like a reward argument (``RESERVED``), or
without a column a chosen built-in reward reads is refused, naming the file and the line
/ row, before any process group starts.

Prompts longer than ``rl.max_prompt_length`` tokens are left out, never cut (a cut
question would be graded against the whole question's answer), and counted in the
run's first lines (verl's ``filter_overlong_prompts``); a dataset all of whose prompts
are too long is refused. The last ``data.val_fraction`` of the kept rows are held out
for evaluation. The order of the rest: fsdpkit.data.prompt_order.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fsdpkit.config import DataConfig
from fsdpkit.data.chat import ChatTemplate
from fsdpkit.data.errors import DataError
from fsdpkit.data.rows import read_rows
from fsdpkit.data.schemas import normalize
from fsdpkit.data.tokenizer import BulkEncoder, Tokenizer, with_bos

RESERVED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
)
"""Keyword arguments of TRL's reward signature: a column of that name could not be
passed beside them."""
SKIPPED = frozenset({"prompt", "completion", "completion_ids"})
"""Columns TRL does not pass to rewards as columns (the prompt goes as ``prompts``)."""


@dataclass(frozen=True, eq=False)
class PromptRow:
    """One prompt, tokenized, with the columns its rewards read."""

    row: int
    """The row's index among all rows of data.path, in file order (0-based)."""
    where: str
    """Where the row is: ``file:line`` (jsonl) or ``file: row N`` (tables)."""
    prompt: str | list[dict[str, Any]]
    """The prompt as the data has it: what reward functions receive as ``prompts``."""
    text: str
    """What the model continues: the string, or the rendered chat template."""
    ids: np.ndarray
    """int64 token ids of ``text``."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Every other column, by name (the rewards' keyword arguments)."""

    @property
    def conversational(self) -> bool:
        """Chat messages (completions then go to rewards as assistant messages)."""
        return isinstance(self.prompt, list)


def _columns(record: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The columns rewards receive ([Note: prompt rows])."""
    clash = sorted(RESERVED & record.keys())
    if clash:
        raise DataError(
            f"{where}: the column {clash[0]!r} has the name of an argument every reward "
            "function receives (prompts, completions, completion_ids, trainer_state, "
            f'log_extra, log_metric). Rename it with data.columns=["{clash[0]}_column='
            f'{clash[0]}"].'
        )
    columns = {k: v for k, v in record.items() if k not in SKIPPED}
    nested = record.get("reward_model")
    if isinstance(nested, dict) and "ground_truth" in nested:
        columns.setdefault("ground_truth", nested["ground_truth"])
    return columns


def _missing(columns: dict[str, Any], required: Mapping[str, Sequence[str]], *, where: str) -> None:
    """Refuse a row lacking every column a reward can read its reference from."""
    for reward, any_of in required.items():
        if any(columns.get(name) is not None for name in any_of):
            continue
        names = " / ".join(map(repr, any_of))
        have = ", ".join(map(repr, columns)) or "none"
        raise DataError(
            f"{where}: the reward {reward!r} (rl.rewards) reads the reference answer from "
            f"the column {names}, and this row has none of them (its other columns: "
            f"{have}; verl's reward_model.ground_truth counts as 'ground_truth'). Add the "
            f'column, map yours with data.columns=["{any_of[0]}=YOUR_COLUMN"], or drop '
            f"{reward!r} from rl.rewards."
        )


def _row(record: Any, *, where: str) -> tuple[str | list[dict[str, Any]], dict[str, Any]]:
    """(prompt, columns) of one record, checked."""
    if not isinstance(record, dict) or "prompt" not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise DataError(
            f"{where}: the row has no 'prompt' column (columns: {keys}); RL prompt rows "
            "need 'prompt' as a string or a list of chat messages (TRL's prompt-only "
            'format). Map your column, e.g. data.columns=["prompt=question"].'
        )
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: the 'prompt' is empty; fill it in or remove the row.")
    elif not isinstance(prompt, list):
        raise DataError(
            f"{where}: 'prompt' must be a string or a list of chat messages ({{role, "
            f"content}}), got {type(prompt).__name__}."
        )
    return prompt, _columns(record, where=where)


class PromptEncoder:
    """Prompts -> text -> ids ([Note: prompt rows]); the chat template is loaded at the
    first conversational prompt, and the ids of many texts come from one batch call."""

    def __init__(self, tokenizer: Tokenizer, *, cfg: DataConfig) -> None:
        self.tokenizer = tokenizer
        self._cfg = cfg
        self._chat: ChatTemplate | None = None

    def render(self, messages: list[dict[str, Any]], *, where: str) -> str:
        """A chat prompt's text: the template with the generation prompt."""
        if self._chat is None:
            self._chat = ChatTemplate.load(self._cfg.tokenizer, data_path=self._cfg.path or "")
        normalized = normalize(messages, where, key="prompt")
        return self._chat.render(normalized, generation_prompt=True)

    def encode(self, texts: Sequence[str], *, chat: bool) -> list[np.ndarray]:
        """int64 ids of rendered chat prompts (no special tokens added: the template
        wrote them) or of string prompts (the run's tokenizer's encode)."""
        if not texts:
            return []
        if chat:
            assert self._chat is not None
            encoded = self._chat.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            return [np.asarray(ids, dtype=np.int64) for ids in encoded]
        if isinstance(self.tokenizer, BulkEncoder):
            ids = [a.astype(np.int64) for a in self.tokenizer.encode_many(list(texts))]
        else:
            ids = [np.asarray(self.tokenizer.encode(t), dtype=np.int64) for t in texts]
        return [with_bos(self.tokenizer, a) for a in ids]  # as TRL's processing_class(text=)


@dataclass
class PromptTable:
    """Every kept prompt of data.path, tokenized and checked (in memory)."""

    train: list[PromptRow]
    val: list[PromptRow]
    too_long: int = 0
    """Prompts left out for having more than max_prompt_length tokens."""
    longest: int = 0
    """Tokens of the longest prompt read (kept or not)."""
    formats: Counter[str] = field(default_factory=Counter)

    def describe(self, *, max_prompt_length: int) -> str:
        kinds = ", ".join(f"{k} ({n:,} rows)" for k, n in sorted(self.formats.items()))
        text = f"prompt data ({kinds}): {len(self.train):,} training prompts"
        if self.val:
            text += f", {len(self.val):,} held out"
        if self.too_long:
            text += (
                f"; {self.too_long:,} prompts longer than rl.max_prompt_length = "
                f"{max_prompt_length} tokens left out (longest: {self.longest:,})"
            )
        return text


def load_prompts(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    max_prompt_length: int,
    required: Mapping[str, Sequence[str]] | None = None,
) -> PromptTable:
    """Read, check and tokenize every prompt row of ``data.path`` ([Note: prompt rows]);
    ``required``: reward name -> the columns it can read its reference from (any one)."""
    encoder = PromptEncoder(tokenizer, cfg=cfg)
    rows: list[PromptRow] = []
    rows_read = read_rows(cfg, what="RL prompts", objective="grpo", keys="'prompt' (+ columns)")
    for index, (record, where) in enumerate(rows_read):
        prompt, columns = _row(record, where=where)
        _missing(columns, required or {}, where=where)
        text = encoder.render(prompt, where=where) if isinstance(prompt, list) else prompt
        rows.append(PromptRow(index, where, prompt, text, np.empty(0, np.int64), columns))
    if not rows:
        raise DataError(f"data.path ({cfg.path}) holds no prompt rows.")
    for chat in (False, True):
        which = [i for i, r in enumerate(rows) if r.conversational == chat]
        for i, ids in zip(which, encoder.encode([rows[i].text for i in which], chat=chat)):
            rows[i] = dataclasses.replace(rows[i], ids=ids)
    return _table(rows, cfg=cfg, max_prompt_length=max_prompt_length)


def _table(rows: list[PromptRow], *, cfg: DataConfig, max_prompt_length: int) -> PromptTable:
    """Long prompts left out and counted, the last val_fraction held out."""
    for r in rows:
        if not len(r.ids):
            raise DataError(f"{r.where}: the prompt encodes to no tokens; fix or remove the row.")
    kept = [r for r in rows if len(r.ids) <= max_prompt_length]
    longest = max(len(r.ids) for r in rows)
    if not kept:
        raise DataError(
            f"data.path ({cfg.path}): every prompt is longer than rl.max_prompt_length = "
            f"{max_prompt_length} tokens (the shortest has {min(len(r.ids) for r in rows)}). "
            "Raise rl.max_prompt_length (the model's context must hold it plus "
            "rl.max_completion_length) or shorten the prompts."
        )
    n_val = int(len(kept) * cfg.val_fraction)
    formats = Counter("conversational" if r.conversational else "standard" for r in kept)
    return PromptTable(
        train=kept[: len(kept) - n_val],
        val=kept[len(kept) - n_val :],
        too_long=len(rows) - len(kept),
        longest=longest,
        formats=formats,
    )
