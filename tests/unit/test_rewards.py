"""Rewards (fsdpkit.rollout): the built-ins on real cases (math through math-verify where
it is installed and through the fallback always), users' functions imported by path and
called with TRL's reward signature, weights, and every failure named with its row."""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fsdpkit.config import RlConfig
from fsdpkit.config.rl import BUILTIN_REWARDS
from fsdpkit.data import ByteTokenizer, load_prompts
from fsdpkit.data.prompts import PromptRow
from fsdpkit.rollout import RewardError, RewardState, build_rewards
from fsdpkit.rollout.final_answer import backends, extract_answer
from fsdpkit.rollout.verifiers import ANSWER_COLUMNS, math_reward

STATE = RewardState(global_step=3, max_steps=10, epoch=0.5)
GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 72"
MATH = r"The sum is $\frac{1}{2} + \frac{1}{4}$, so the answer is $\boxed{\frac{3}{4}}$."


def _rows(tmp_path: Path, rows: list[dict[str, Any]], name: str = "p.jsonl") -> list[PromptRow]:
    from fsdpkit.config import DataConfig

    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), val_fraction=0.0)
    return load_prompts(cfg, ByteTokenizer(), max_prompt_length=512).train


def _row(prompt: Any = "Q?", **columns: Any) -> PromptRow:
    return PromptRow(0, "mem:1", prompt, str(prompt), np.asarray([1]), columns)


def _score(specs: list[str], rows: list[PromptRow], texts: list[str], **rl: Any) -> Any:
    rewards = build_rewards(RlConfig(rewards=specs, **rl))
    ids = [list(t.encode()) for t in texts]
    return rewards.score(rows, texts, ids, state=STATE)


@pytest.mark.parametrize("backend", backends())
def test_math_compares_final_answers(backend: str) -> None:
    cases = [  # (completion, reference, expected)
        ("So she sold 72 clips.", GSM8K, 1.0),  # GSM8K answer column: after ####
        ("... #### 72", "72", 1.0),
        ("She sold 70 clips.", GSM8K, 0.0),
        (r"Therefore \boxed{0.75}", MATH, 1.0),  # MATH solution column: its \boxed
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        ("The total is 1,000 dollars.", "1000", 1.0),
        ("The total is 1000.", 1000, 1.0),  # a numeric column
        ("It is -2.", "-2", 1.0),
        ("It is 2.", "-2", 0.0),
        ("I cannot tell.", "5", 0.0),  # no answer in the completion
        ("x is 7", ["5", "7"], 1.0),  # several acceptable references
    ]
    completions = [c for c, _, _ in cases]
    got = math_reward(completions, backend=backend, answer=[r for _, r, _ in cases])
    assert got == [e for _, _, e in cases]


def test_math_verify_is_symbolic_where_installed() -> None:
    if "math-verify" not in backends():
        assert backends() == ("fallback",)  # the fallback alone: math-verify not installed
        assert math_reward([r"\boxed{1+x}"], backend="fallback", answer=["x+1"]) == [0.0]
        return
    got = math_reward(
        [r"\boxed{1+x}", r"\boxed{\sqrt{2}}"], backend="math-verify", answer=["x+1", "2^{1/2}"]
    )
    assert got == [1.0, 1.0]


def test_answer_extraction_takes_the_last_boxed_then_hashes_then_number() -> None:
    assert extract_answer(r"first \boxed{1}, then \boxed{\frac{2}{3}} and 9") == r"\frac{2}{3}"
    assert extract_answer("a 3 b\n#### 12.\nextra 5") == "12"
    assert extract_answer("x = -3, y = 4/5") == "4/5"
    assert extract_answer("5-3") == "3" and extract_answer("none") is None


def test_exact_format_and_length(tmp_path: Path) -> None:
    rows = [_row(answer=" yes "), _row(solution="no")]
    assert _score(["exact"], rows, ["yes\n", "No"]).total.tolist() == [1.0, 0.0]
    think = "<think>\nadd them\n</think>\n<answer>5</answer>\n"
    got = _score(["format"], rows, [think, "<answer>5</answer>"])
    assert got.total.tolist() == [1.0, 0.0]
    custom = _score(["format"], rows, ["42", "4 2"], format_pattern=r"\d+")
    assert custom.total.tolist() == [1.0, 0.0]
    import trl.rewards as trl_rewards  # DAPO's penalty as TRL 1.16 computes it (dev extra)

    theirs = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)
    lengths = [0, 5, 12, 13, 16, 19, 20]
    ids = [[7] * n for n in lengths]
    rewards = build_rewards(
        RlConfig(rewards=["length"], max_completion_length=20, soft_punish_cache=8)
    )
    ours = rewards.score([rows[0]] * len(ids), ["x"] * len(ids), ids, state=STATE)
    assert ours.total.tolist() == pytest.approx(theirs(completion_ids=ids))
    assert ours.total.tolist() == pytest.approx([0, 0, 0, -1 / 8, -4 / 8, -7 / 8, -1])


def test_every_builtin_name_is_implemented_and_declares_its_columns() -> None:
    rewards = build_rewards(RlConfig(rewards=list(BUILTIN_REWARDS)))
    assert [f.name for f in rewards.funcs] == list(BUILTIN_REWARDS)
    assert rewards.required_columns == {"math": ANSWER_COLUMNS, "exact": ANSWER_COLUMNS}
    assert "math (" in rewards.describe() and "length x 1" in rewards.describe()


USER_MODULE = '''
import asyncio
SEEN = {}

def brevity(prompts, completions, completion_ids, **kwargs):
    """A TRL-style reward: every argument arrives by keyword."""
    SEEN.update(kwargs, prompts=prompts, completions=completions, completion_ids=completion_ids)
    kwargs["log_metric"]("brevity/calls", 1.0)
    kwargs["log_extra"]("seen_level", kwargs["level"])
    return [1.0 / (1 + len(ids)) for ids in completion_ids]

async def slow_yes(completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0 for _ in completions]

def broken_on_nine(completions, answer, **kwargs):
    return [1.0 / (int(a) - 9) for a in answer]

def wrong_length(completions, **kwargs):
    return [1.0]

def nan_for_second(completions, **kwargs):
    return [0.5, float("nan")] + [0.5] * (len(completions) - 2)

def none_for_last(completions, **kwargs):
    return [1.0] * (len(completions) - 1) + [None]

def inf_value(completions, **kwargs):
    return [float("inf")] * len(completions)

def text_value(completions, **kwargs):
    return ["high"] * len(completions)

def not_a_list(completions, **kwargs):
    return 3.0

def whole_batch_only(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("the grader's server is down")
    return [0.0]
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``myrewards.funcs`` written to tmp_path and put on sys.path, as a user's module."""
    package = tmp_path / "myrewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "funcs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("myrewards", "myrewards.funcs", "other")
    for name in names:
        sys.modules.pop(name, None)
    yield importlib.import_module("myrewards.funcs")
    for name in names:
        sys.modules.pop(name, None)


def test_a_trl_style_function_gets_trls_arguments(tmp_path: Path, user_module: Any) -> None:
    chat = [{"role": "user", "content": "2+2?"}]
    rows = [_row("Say hi", answer="hi", level=1), _row(chat, answer="4", level=2)]
    rows = [r for r in rows for _ in range(2)]  # G = 2 completions per prompt
    scores = _score(["myrewards.funcs:brevity", "myrewards.funcs:slow_yes"], rows,
                    ["hi", "hello", "4", "four"])  # fmt: skip
    seen = user_module.SEEN
    assert seen["prompts"] == ["Say hi", "Say hi", chat, chat]
    assert seen["completions"][:2] == ["hi", "hello"]  # strings for string prompts
    assert seen["completions"][2] == [{"role": "assistant", "content": "4"}]  # chat: messages
    assert seen["completion_ids"][0] == [104, 105]
    assert seen["answer"] == ["hi", "hi", "4", "4"] and seen["level"] == [1, 1, 2, 2]
    assert seen["trainer_state"].global_step == 3 and seen["trainer_state"].max_steps == 10
    assert scores.per_reward["brevity"].tolist() == pytest.approx([1 / 3, 1 / 6, 1 / 2, 1 / 5])
    assert scores.per_reward["slow_yes"].tolist() == [1.0] * 4  # an async def reward
    assert scores.metrics == {"brevity/calls": [1.0]} and scores.extra == {
        "seen_level": [1, 1, 2, 2]
    }


def test_weights_sum_and_each_reward_is_kept(user_module: Any) -> None:
    rows = [_row(answer="5"), _row(answer="6")]
    scores = _score(
        ["math", "myrewards.funcs:slow_yes"], rows, ["5", "7"], reward_weights=[2.0, -0.5]
    )
    assert scores.per_reward["math"].tolist() == [1.0, 0.0]
    assert scores.total.dtype == torch.float32
    assert scores.total.tolist() == [1.5, -0.5]


def test_trls_own_reward_functions_run_unchanged() -> None:
    import trl.rewards as trl_rewards  # the dev extra: the oracle never skips

    rewards = build_rewards(RlConfig(rewards=["trl.rewards:think_format_reward"]))
    chat = [{"role": "user", "content": "hi"}]
    texts = ["<think>\nhm\n</think>\nhello", "hello"]
    scores = rewards.score([_row(chat)] * 2, texts, [[1], [2]], state=STATE)
    assert scores.per_reward["think_format_reward"].tolist() == [1.0, 0.0]
    assert trl_rewards.think_format_reward([[{"content": t}] for t in texts]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("function", "needles"),
    [
        ("broken_on_nine", ["raised ZeroDivisionError", "p.jsonl:3", "dataset row 2"]),
        ("whole_batch_only", ["raised RuntimeError", "no single completion raises alone"]),
        ("wrong_length", ["returned 1 values for 4 completions", "p.jsonl:1"]),
        ("nan_for_second", ["returned nan", "p.jsonl:2", "dataset row 1", "completion 'b'"]),
        ("none_for_last", ["returned None", "p.jsonl:4", "dataset row 3"]),
        ("inf_value", ["returned inf", "p.jsonl:1"]),
        ("text_value", ["returned 'high'"]),
        ("not_a_list", ["returned float, not a list"]),
    ],
)
def test_each_failure_names_the_function_and_the_row(
    tmp_path: Path, user_module: Any, function: str, needles: list[str]
) -> None:
    rows = _rows(
        tmp_path, [{"prompt": f"Q{i}", "answer": str(a)} for i, a in enumerate([1, 2, 9, 4])]
    )
    with pytest.raises(RewardError) as info:
        _score([f"myrewards.funcs:{function}"], rows, ["a", "b", "c", "d"])
    message = str(info.value)
    assert f"'myrewards.funcs:{function}'" in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_imports_that_fail_name_the_entry(user_module: Any) -> None:
    with pytest.raises(RewardError, match=r"rl\.rewards\[1\] = 'nosuch\.mod:f'.*PYTHONPATH"):
        build_rewards(RlConfig(rewards=["math", "nosuch.mod:f"]))
    with pytest.raises(RewardError, match="has no function 'missing'"):
        build_rewards(RlConfig(rewards=["myrewards.funcs:missing"]))


def test_two_functions_with_one_name_keep_their_specs(user_module: Any, tmp_path: Path) -> None:
    other = tmp_path / "other.py"
    other.write_text("def slow_yes(completions, **kw):\n    return [0.0] * len(completions)\n")
    rewards = build_rewards(RlConfig(rewards=["myrewards.funcs:slow_yes", "other:slow_yes"]))
    assert [f.name for f in rewards.funcs] == ["myrewards.funcs:slow_yes", "other:slow_yes"]
    assert math.isclose(rewards.funcs[1].weight, 1.0)
