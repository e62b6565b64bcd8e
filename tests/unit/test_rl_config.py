"""The [rl] section: TRL's names and defaults, documented fields, and every refusal
naming its key and the fix, before any worker starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fsdpkit import config as c
from fsdpkit.config import ConfigError, RlConfig
from fsdpkit.config.rl import LOSS_TYPES

GRPO = ["train.objective=grpo", "data.path=prompts.jsonl", "rl.rewards=math"]


def test_defaults_are_trls() -> None:
    import trl  # TRL 1.16 is in the dev extra: the oracle never skips

    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    shared = [
        "num_generations",
        "temperature",
        "top_p",
        "top_k",
        "loss_type",
        "epsilon",
        "epsilon_high",
        "beta",
        "scale_rewards",
        "num_iterations",
        "mask_truncated_completions",
        "importance_sampling_level",
    ]
    assert {k: getattr(RlConfig(), k) for k in shared} == {k: theirs[k] for k in shared}
    for loss_type in LOSS_TYPES:  # each one TRL documents
        assert f"'{loss_type}'" in trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]


def test_every_field_is_documented() -> None:
    docs = c.field_docs(RlConfig)
    assert [f.name for f in dataclasses.fields(RlConfig) if not docs.get(f.name)] == []
    text = c.describe()
    assert "[rl]" in text and "rl.logprob_gap_max" in text
    assert "'grpo'" in text.split("train.objective")[1].split("\n")[0]


def test_a_grpo_config_loads_and_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = c.load(
        None,
        [
            *GRPO[:2],
            "rl.rewards=math,format,mypkg.rewards:brevity",
            "rl.reward_weights=[1,0.5,0.1]",
            "rl.stop=</answer>",
            "rl.epsilon_high=0.28",
            r"rl.format_pattern=^\d+$",
        ],
    )
    assert cfg.rl.rewards == ["math", "format", "mypkg.rewards:brevity"]
    assert cfg.rl.reward_weights == [1.0, 0.5, 0.1] and cfg.rl.stop == ["</answer>"]
    path = tmp_path / "config.toml"
    path.write_text(c.to_toml(cfg))
    assert c.load(path) == cfg


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["rl.reward_weights=[1,2]"], ["rl.reward_weights has 2", "rl.rewards has 1", "math"]),
        (["rl.epsilon_high=0.1"], ["rl.epsilon_high = 0.1", "below rl.epsilon = 0.2"]),
        (["rl.rewards=maths"], ["rl.rewards[0] = 'maths'", "Did you mean 'math'"]),
        (["rl.rewards=pkg.mod"], ["Valid: math, exact, format, length", "package.module:function"]),
        (["rl.rewards=pkg mod:f"], ["rl.rewards[0]", "package.module:function"]),
        (["rl.rewards=math,math"], ["names 'math' twice"]),
        (["rl.loss_type=dapoo"], ["rl.loss_type", "Did you mean 'dapo'"]),
        (["rl.loss_type=vespo"], ["'vespo'", "does not offer"]),
        (["rl.num_generations=1"], ["rl.num_generations = 1", ">= 2"]),
        (["rl.temperature=0"], ["rl.temperature"]),
        (["rl.top_p=1.5"], ["rl.top_p"]),
        (["rl.top_k=-1"], ["rl.top_k"]),
        (["rl.logprob_gap_max=0"], ["rl.logprob_gap_max"]),
        (["rl.soft_punish_cache=300"], ["rl.soft_punish_cache = 300"]),
        (["rl.format_pattern=(unclosed"], ["rl.format_pattern", "regular expression"]),
        (["rl.engine=vllm", "rl.top_p=0.9"], ["rl.top_p = 0.9", "processed_logprobs"]),
        (["rl.engine=vllm", "rl.top_k=5"], ["rl.top_k = 5", "rl.engine = 'embedded'"]),
        (["rl.engine=vllm", "model.factory=pkg.mod:fn"], ["model.factory", "model.hf"]),
        (["rl.engine=vllm", "rl.vllm_sync_bucket_mb=0"], ["rl.vllm_sync_bucket_mb"]),
        (
            ["rl.engine=vllm", "rl.vllm_importance_sampling_clip_min=4"],
            ["rl.vllm_importance_sampling_clip_min = 4.0", "clip_max = 3.0"],
        ),
        (["rl.vllm_importance_sampling_mode=token"], ["Did you mean 'token_mask'"]),
        (["rl.engine=vlm"], ["rl.engine", "Did you mean 'vllm'"]),
        (["rl.scale_rewards=grp"], ["rl.scale_rewards", "Did you mean 'group'"]),
        (["rl.reward_weights=[nan]"], ["finite"]),
    ],
)
def test_bad_values_name_the_key_and_the_fix(overrides: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        c.load(None, [*GRPO, *overrides])
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize("axis", ["tp", "cp", "pp", "ep"])
def test_grpo_refuses_other_parallel_axes_by_key(axis: str) -> None:
    with pytest.raises(ConfigError, match=rf"parallel\.{axis} = 2 is not supported with"):
        c.load(None, [*GRPO, f"parallel.{axis}=2"])


def test_grpo_needs_rewards_and_a_prompt_path() -> None:
    with pytest.raises(ConfigError, match=r"needs at least one reward: set rl\.rewards"):
        c.load(None, GRPO[:2])
    with pytest.raises(ConfigError, match=r"data\.path must name a file"):
        c.load(None, ["train.objective=grpo", "rl.rewards=math"])
    # another objective ignores the rl section's run needs (its ranges still hold)
    assert c.load(None, ["rl.rewards=math"]).train.objective == "lm"
    with pytest.raises(ConfigError, match=r"rl\.top_p"):
        c.load(None, ["rl.top_p=0"])


def test_the_global_batch_counts_whole_groups_of_completions() -> None:
    with pytest.raises(ConfigError, match=r"train\.global_batch_size = 12 is not a multiple"):
        c.load(None, [*GRPO, "rl.num_generations=8", "train.global_batch_size=12"])
    c.load(None, [*GRPO, "rl.num_generations=4", "train.global_batch_size=12"])


def test_compile_is_refused_under_grpo_by_name() -> None:
    with pytest.raises(ConfigError, match=r"train\.compile = true is not supported"):
        c.load(None, [*GRPO, "train.compile=true"])


def test_the_context_holds_a_prompt_and_its_completion() -> None:
    from fsdpkit.config.rl_rules import with_rl_context

    short = c.load(None, [*GRPO, "data.seq_len=128", "rl.max_prompt_length=100"])
    assert with_rl_context(short).data.seq_len == 100 + 256
    long = c.load(None, [*GRPO, "data.seq_len=1024"])
    assert with_rl_context(long).data.seq_len == 1024
    assert with_rl_context(c.load(None, ["data.seq_len=64"])).data.seq_len == 64  # not grpo


def test_the_gap_limit_follows_the_compute_dtype_unless_set() -> None:
    from fsdpkit.config.rl import gap_limit

    assert gap_limit(RlConfig(), low_precision=False) == 1e-3
    assert gap_limit(RlConfig(), low_precision=True) == 0.1
    assert gap_limit(RlConfig(logprob_gap_max=0.05), low_precision=False) == 0.05
