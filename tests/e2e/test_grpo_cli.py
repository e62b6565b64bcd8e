"""``fsdpkit train train.objective=grpo`` as a user runs it (docs/rl.md, README's GRPO
quick start): a 2-rank run says what it samples and how in its first lines, logs the
rl/* metrics every step with the rollout's log-prob gap at float noise (fp32), and the
held-out reward and pass rate at the end; a reward name that does not exist and a
prompt file without the column its reward reads each stop with one paragraph naming
the key or the column, exit 2, no traceback. The three commands run at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import metrics, start

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

GRPO = [
    "train.objective=grpo",
    'rl.rewards=["exact"]',
    'rl.stop=["\\n"]',
    "rl.num_generations=4",
    "rl.max_completion_length=4",
    "rl.max_prompt_length=8",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.steps=2",
    "train.eval_every=2",
    "train.sample_tokens=0",
    "data.val_fraction=0.25",
    "precision.mode=fp32",
    "checkpoint.every=0",
    "logging.report=false",
    "model.n_layers=2",
    "model.dim=64",
    "model.ffn_dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
]
ROLLOUT_KEYS = {
    "rl/reward", "rl/reward_std", "rl/zero_spread_share", "rl/completion_len_mean",
    "rl/completion_len_max", "rl/completion_len_min", "rl/truncated_share",
    "rl/logprob_gap_mean", "rl/logprob_gap_max", "rl/rollout_tokens_per_s", "rl/rollout_s",
    "rl/rewards/exact", "rl/pass_rate", "rl/clip_ratio/low_mean", "rl/clip_ratio/high_mean",
    "rl/clip_ratio/region_mean", "rl/entropy",
}  # fmt: skip
"""What every step of this run writes (docs/rl.md#metrics lists them all)."""


def _rows(path: Path, *, answers: bool) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    if not answers:
        rows = [{"prompt": r["prompt"]} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refusal(err: str, out: str) -> str:
    """The one paragraph a refused command prints."""
    assert "Traceback" not in err + out, err[-3000:]
    paragraphs = [p for p in err.strip().split("\n\n") if p.strip()]
    assert len(paragraphs) == 1, err
    return paragraphs[0]


def test_a_grpo_run_logs_rl_metrics_and_bad_specs_are_one_paragraph(tmp_path: Path) -> None:
    good, bare = (
        _rows(tmp_path / "add.jsonl", answers=True),
        _rows(tmp_path / "bare.jsonl", answers=False),
    )
    run_dir = tmp_path / "run"
    run = start("train", *GRPO, f"data.path={good}", f"logging.run_dir={run_dir}", cwd=tmp_path)
    bad_reward = start("train", *GRPO, f"data.path={good}", 'rl.rewards=["exactt"]', cwd=tmp_path)
    no_answer = start(
        "train", *GRPO, f"data.path={bare}", f"logging.run_dir={tmp_path / 'bare'}", cwd=tmp_path
    )

    out, err = bad_reward.communicate(timeout=120)
    assert bad_reward.returncode == 2, err[-2000:]
    message = _refusal(err, out)
    assert "rl.rewards[0] = 'exactt' is not a built-in reward" in message
    assert "'exact'" in message  # the closest name

    out, err = no_answer.communicate(timeout=240)
    assert no_answer.returncode == 2, err[-2000:]
    message = _refusal(err, out)
    assert f"{bare}:1" in message and "'answer'" in message and "exact" in message, message

    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    text = out + err
    assert "GRPO: 4 completions per prompt from the embedded engine" in text
    assert "12 training prompts, 4 held out" in text
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert set(record) >= ROLLOUT_KEYS, ROLLOUT_KEYS - set(record)
        assert record["rl/logprob_gap_max"] <= 1e-5  # fp32: float noise
        assert record["rl/completion_len_max"] <= 4
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    held_out = [r for r in map(json.loads, lines) if "val_pass_rate" in r]
    assert [r["step"] for r in held_out] == [2]
    assert 0.0 <= held_out[0]["val_pass_rate"] <= 1.0 and "val_reward" in held_out[0]
