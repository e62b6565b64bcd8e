"""Reward functions: the built-ins and users' own, with TRL's reward signature.

[Note: reward functions]
Every reward, built-in or a user's ``"package.module:function"`` from ``rl.rewards``, is
called as TRL 1.16's GRPOTrainer calls one::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...],
       trainer_state=state, log_extra=..., log_metric=..., **columns) -> list[float]

one entry per completion (G completions of a prompt are consecutive, the prompt and
its columns repeated): ``prompts`` as the data has them, ``completions`` strings for
string prompts and ``[{"role": "assistant", "content": text}]`` for chat prompts,
``completion_ids`` lists of ints, every other column of the rows by name (a column a
row lacks is None), ``trainer_state`` with ``global_step`` / ``max_steps`` / ``epoch``,
``log_extra(column, values)`` and ``log_metric(name, value)`` collected into the
``Scores``. A TRL user's function runs unchanged (``async def`` ones too). The total is
``sum_i w_i r_i`` (``rl.reward_weights``, in float32 as TRL sums); each reward's own
values are kept for the metrics.

Where TRL turns ``None`` into NaN and averages around it, fsdpkit stops: a reward that
raises, returns the wrong number of values, or a value that is None, not a number, NaN
or infinite raises ``RewardError`` naming the function and the dataset row (file and
line / row) of the completion, so a broken grader never trains a step. (A function that
raises for the whole batch is called again one completion at a time to find the row.)
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpkit.config.rl import BUILTIN_REWARDS, RlConfig
from fsdpkit.data.prompts import PromptRow
from fsdpkit.errors import UserError
from fsdpkit.rollout.final_answer import math_backend
from fsdpkit.rollout.verifiers import builtin, text_of


class RewardError(UserError):
    """A reward function failed or returned something that is not a reward."""


@dataclass(frozen=True)
class RewardState:
    """What TRL's ``trainer_state`` offers reward functions that shape by progress."""

    global_step: int
    """Optimizer steps done before this rollout."""
    max_steps: int
    """The run's train.steps."""
    epoch: float = 0.0
    """Epochs of the prompt data done (fractional)."""


@dataclass(frozen=True)
class RewardFn:
    """One entry of rl.rewards."""

    name: str
    """Its name in the metrics: the built-in's, or the function's (its spec if two
    functions share a name)."""
    spec: str
    """As rl.rewards names it."""
    fn: Callable[..., Any]
    weight: float
    columns: tuple[str, ...] = ()
    """A built-in's reference columns (any one must be present); () = none."""


@dataclass
class Scores:
    """The rewards of a batch of completions ([Note: reward functions])."""

    total: torch.Tensor
    """float32 (n,): sum_i w_i r_i per completion."""
    per_reward: dict[str, torch.Tensor]
    """Each reward's own float32 (n,) values, by RewardFn.name (unweighted)."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """What the functions passed to log_metric(name, value)."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """What the functions passed to log_extra(column, values)."""


def load_reward(spec: str, *, index: int) -> Callable[..., Any]:
    """Import a user's ``package.module:function``; errors name the rl.rewards entry."""
    module_name, _, attr = spec.partition(":")
    where = f"rl.rewards[{index}] = {spec!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardError(
            f"{where}: importing module {module_name!r} failed ({type(exc).__name__}: "
            f"{exc}). Put the module on PYTHONPATH (every rank imports it), or fix the name."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"{where}: module {module_name!r} has no function {attr!r}.")
    return fn


def build_rewards(rl: RlConfig) -> Rewards:
    """The reward functions rl.rewards names, with their weights (1.0 when
    rl.reward_weights is empty); user functions are imported here."""
    weights = rl.reward_weights or [1.0] * len(rl.rewards)
    made: list[tuple[str, Callable[..., Any], tuple[str, ...]]] = []
    for index, spec in enumerate(rl.rewards):
        if spec in BUILTIN_REWARDS:
            fn, columns = builtin(spec, rl)
            made.append((spec, fn, columns))
        else:
            fn = load_reward(spec, index=index)
            made.append((getattr(fn, "__name__", spec), fn, ()))
    names = [name for name, _, _ in made]
    return Rewards(
        [
            RewardFn(name if names.count(name) == 1 else spec, spec, fn, float(w), columns)
            for (name, fn, columns), spec, w in zip(made, rl.rewards, weights)
        ]
    )


class _Logs:
    """Collects what reward functions pass to log_extra / log_metric."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list[Any]] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra[column].extend(values)


PER_ROW = ("prompts", "completions", "completion_ids")
"""Keyword arguments with one entry per completion (besides the columns)."""


class Rewards:
    """The run's reward functions ([Note: reward functions])."""

    def __init__(self, funcs: list[RewardFn]) -> None:
        self.funcs = funcs

    @property
    def required_columns(self) -> dict[str, tuple[str, ...]]:
        """Reward name -> the columns a row must have one of (for open_prompt_data)."""
        return {f.name: f.columns for f in self.funcs if f.columns}

    def describe(self) -> str:
        """The rewards line of the run's first lines."""
        parts = []
        for f in self.funcs:
            how = f" ({math_backend()})" if f.spec == "math" else ""
            parts.append(f"{f.spec}{how} x {f.weight:g}")
        return "rewards: " + " + ".join(parts)

    def score(
        self,
        rows: Sequence[PromptRow],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        *,
        state: RewardState,
    ) -> Scores:
        """Score completion ``i`` of prompt ``rows[i]`` (``batch.repeat(G)`` lays out G
        per prompt); ``completions`` are the decoded texts without special tokens (EOS,
        end of turn), as TRL decodes them."""
        if not len(rows) == len(completions) == len(completion_ids):
            raise ValueError(
                f"{len(rows)} rows, {len(completions)} completions and "
                f"{len(completion_ids)} id lists: one of each per completion"
            )
        logs = _Logs()
        kwargs = _kwargs(rows, completions, completion_ids, state=state, logs=logs)
        per_reward = {}
        for f in self.funcs:
            values = _call(f, kwargs, rows)
            per_reward[f.name] = torch.tensor(values, dtype=torch.float32)
        weights = torch.tensor([f.weight for f in self.funcs], dtype=torch.float32)
        stacked = torch.stack(list(per_reward.values()), dim=1)
        total = (stacked * weights).sum(dim=1)
        return Scores(total, per_reward, dict(logs.metrics), dict(logs.extra))


def _kwargs(
    rows: Sequence[PromptRow],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    *,
    state: RewardState,
    logs: _Logs,
) -> dict[str, Any]:
    names = list(dict.fromkeys(k for r in rows for k in r.columns))
    columns = {k: [r.columns.get(k) for r in rows] for k in names}
    return {
        "prompts": [r.prompt for r in rows],
        "completions": [
            [{"role": "assistant", "content": c}] if r.conversational else c
            for r, c in zip(rows, completions)
        ],
        "completion_ids": [[int(t) for t in ids] for ids in completion_ids],
        **columns,
        "trainer_state": state,
        "log_extra": logs.log_extra,
        "log_metric": logs.log_metric,
    }


def _run(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**kwargs))
    return fn(**kwargs)


def _one(kwargs: dict[str, Any], i: int, columns: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments of completion ``i`` alone (logs go nowhere)."""
    out = {k: (v[i : i + 1] if k in PER_ROW or k in columns else v) for k, v in kwargs.items()}
    spare = _Logs()
    return out | {"log_extra": spare.log_extra, "log_metric": spare.log_metric}


def _call(f: RewardFn, kwargs: dict[str, Any], rows: Sequence[PromptRow]) -> list[float]:
    """``f``'s values, checked ([Note: reward functions])."""
    try:
        out = _run(f.fn, kwargs)
    except Exception as exc:
        raise _raised(f, kwargs, rows, exc) from exc
    try:
        values = list(out)
    except TypeError:
        raise RewardError(
            f"The reward {f.spec!r} returned {type(out).__name__}, not a list of floats "
            "(one per completion). Return a list."
        ) from None
    if len(values) != len(rows):
        raise RewardError(
            f"The reward {f.spec!r} returned {len(values)} values for {len(rows)} "
            f"completions (of {_span(rows)}); it must return one per completion."
        )
    return [
        _checked(f, v, row=rows[i], completion=kwargs["completions"][i])
        for i, v in enumerate(values)
    ]


def _checked(f: RewardFn, value: Any, *, row: PromptRow, completion: Any) -> float:
    number = None
    if value is not None and not isinstance(value, str):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    if number is None or not math.isfinite(number):
        raise RewardError(
            f"The reward {f.spec!r} returned {value!r} for the completion of {row.where} "
            f"(dataset row {row.row}; completion {_short(completion)}). A reward must be a "
            "finite number for every completion: fsdpkit never averages around a missing "
            "one. Make the function return a number (e.g. 0.0 when it cannot grade)."
        )
    return number


def _raised(
    f: RewardFn, kwargs: dict[str, Any], rows: Sequence[PromptRow], exc: Exception
) -> RewardError:
    """The error for a function that raised, naming the first row it raises for alone."""
    columns = [k for k in kwargs if k not in PER_ROW and isinstance(kwargs[k], list)]
    culprit = None
    for i in range(len(rows)):
        try:
            _run(f.fn, _one(kwargs, i, columns))
        except Exception:
            culprit = i
            break
    if culprit is None:
        at = f"a batch of {_span(rows)} (no single completion raises alone)"
    else:
        row = rows[culprit]
        at = f"the completion of {row.where} (dataset row {row.row}; completion "
        at += f"{_short(kwargs['completions'][culprit])})"
    return RewardError(
        f"The reward {f.spec!r} raised {type(exc).__name__}: {exc} on {at}. A failing "
        "reward is never skipped or averaged around: fix the function (return 0.0 for "
        "completions it cannot grade) and resume from the last checkpoint."
    )


def _short(completion: Any, limit: int = 60) -> str:
    text = text_of(completion)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _span(rows: Sequence[PromptRow]) -> str:
    wheres = list(dict.fromkeys(r.where for r in rows))
    return ", ".join(wheres[:3]) + (f" and {len(wheres) - 3} more rows" if len(wheres) > 3 else "")
