"""The built-in rewards (``rl.rewards`` = math, exact, format, length), each a function
with TRL's reward signature ([Note: reward functions] in fsdpkit.rollout.rewards).

- ``math``: 1.0 when the completion's final answer equals the row's reference answer
  ([Note: math answers] in fsdpkit.rollout.final_answer), else 0.0;
- ``exact``: 1.0 when the completion, stripped, equals the reference, stripped;
- ``format``: 1.0 when the whole stripped completion matches ``rl.format_pattern``
  (``.`` matching newlines), else 0.0;
- ``length``: DAPO's soft overlong punishment: 0 up to ``max_completion_length -
  soft_punish_cache`` tokens, then linearly down to -1 at ``max_completion_length``.

math and exact read the reference from the first of ``ANSWER_COLUMNS`` a row has; the
prompt data refuses rows with none of them (``Rewards.required_columns``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from fsdpkit.config.rl import RlConfig
from fsdpkit.rollout.final_answer import answer_matches, math_backend

ANSWER_COLUMNS = ("answer", "ground_truth", "solution")
"""Where the math and exact rewards read a row's reference, the first one present
(verl's reward_model.ground_truth arrives as ground_truth: fsdpkit.data.prompts)."""


def text_of(completion: Any) -> str:
    """The text of a completion as TRL passes it (a string, or one assistant message)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def _reference(columns: dict[str, list[Any]], i: int) -> Any:
    for name in ANSWER_COLUMNS:
        values = columns.get(name)
        if values is not None and values[i] is not None:
            return values[i]
    return None


def math_reward(completions: list[Any], *, backend: str, **columns: Any) -> list[float]:
    """1.0 when the completion's final answer equals the row's reference answer
    ([Note: math answers] in fsdpkit.rollout.final_answer), else 0.0."""
    return [
        float(answer_matches(text_of(c), _reference(columns, i), backend=backend))
        for i, c in enumerate(completions)
    ]


def exact_reward(completions: list[Any], **columns: Any) -> list[float]:
    """1.0 when the completion, stripped, equals the reference answer, stripped."""
    return [
        float(text_of(c).strip() == str(_reference(columns, i)).strip())
        for i, c in enumerate(completions)
    ]


def format_reward(completions: list[Any], *, pattern: str, **_: Any) -> list[float]:
    """1.0 when the whole stripped completion matches rl.format_pattern ('.' matches
    newlines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]


def length_reward(
    completion_ids: list[list[int]], *, limit: int, cache: int, **_: Any
) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to ``limit - cache`` tokens, then linearly
    down to -1 at ``limit``, -1 beyond (limit = rl.max_completion_length)."""
    start = limit - cache
    return [
        0.0 if len(ids) <= start else max((start - len(ids)) / cache, -1.0)
        for ids in completion_ids
    ]


def builtin(name: str, rl: RlConfig) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """(function, reference columns) of a built-in reward."""
    if name == "math":
        return functools.partial(math_reward, backend=math_backend()), ANSWER_COLUMNS
    if name == "exact":
        return exact_reward, ANSWER_COLUMNS
    if name == "format":
        return functools.partial(format_reward, pattern=rl.format_pattern), ()
    if name != "length":
        raise ValueError(f"{name!r} is not a built-in reward")
    limit = rl.max_completion_length
    cache = rl.soft_punish_cache or max(limit // 4, 1)
    return functools.partial(length_reward, limit=limit, cache=cache), ()
