"""``fsdpkit train train.objective=dpo`` as a user runs it: it learns a rule, and a bad
row stops it with one line.

Learning check: 640 synthetic pairs whose chosen answer repeats the prompt's last letter
three times and whose rejected answer repeats another of the same six letters (so only
the rule tells them apart), the built-in tiny Llama (2 layers, d = 64, byte tokenizer),
2 ranks, 32 pairs per step, beta 1, lr 5e-3: the reward accuracy of steps 11-20 (pairs
the run has never trained on: one epoch is 20 steps) must average above 0.9 (measured:
0.97-1.0 from step 10; step 1 is 0, every reward being 0). A bad row (identical chosen
and rejected) is one line naming the file and line, exit 2, no traceback. Both commands
run at once; ``fsdpkit report`` then plots the rewards and the accuracy. Under pp2 a
full fine-tune learns the rule too, its reference in the policy's stages.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from clirun import fsdpkit, metrics, start

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

MODEL = ["model.n_layers=2", "model.dim=64", "model.ffn_dim=128", "model.n_heads=4"]


def _rule_rows(n: int) -> list[dict[str, str]]:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        prompt = "".join(rng.choice("abcdef") for _ in range(6))
        other = rng.choice([c for c in "abcdef" if c != prompt[-1]])
        rows.append({"prompt": prompt, "chosen": prompt[-1] * 3, "rejected": other * 3})
    return rows


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_learns_a_rule_and_a_bad_row_is_one_line(tmp_path: Path) -> None:
    good = _write(tmp_path / "rule.jsonl", _rule_rows(640))
    bad_rows = [*_rule_rows(3), {"prompt": "abc", "chosen": "ccc", "rejected": "ccc"}]
    bad = _write(tmp_path / "bad.jsonl", bad_rows)
    common = ["train.objective=dpo", "train.sample_tokens=0", "logging.report=false", *MODEL]
    learn = start(
        "train",
        *common,
        f"data.path={good}",
        f"logging.run_dir={tmp_path / 'learn'}",
        "train.steps=20",
        "train.global_batch_size=32",
        "train.warmup_steps=5",
        "train.lr=5e-3",
        "train.schedule=constant",
        "dpo.beta=1.0",
        "data.seq_len=16",
        "data.val_fraction=0",
        "train.eval_every=0",
        cwd=tmp_path,
    )
    refused = start(
        "train", *common, f"data.path={bad}", f"logging.run_dir={tmp_path / 'bad'}", cwd=tmp_path
    )
    out, err = refused.communicate(timeout=240)
    assert refused.returncode == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{bad}:4: 'chosen' and 'rejected' are identical" in lines[0], err
    assert "Traceback" not in err + out

    out, err = learn.communicate(timeout=300)
    assert learn.returncode == 0, err[-3000:]
    records = metrics(tmp_path / "learn")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[0]["rewards/accuracy"] == 0.0  # policy = reference: every reward is 0
    later = [r["rewards/accuracy"] for r in records[10:]]
    assert sum(later) / len(later) > 0.9, later
    assert records[-1]["rewards/margin"] > 1.0 and records[-1]["loss"] < 0.3
    assert "preference data (standard (640 rows)): 640 training pairs" in out + err
    report = fsdpkit("report", str(tmp_path / "learn"), cwd=tmp_path)  # the report's plots
    assert report.returncode == 0, report.stderr[-2000:]
    plots = tmp_path / "learn" / "plots"
    assert (plots / "rewards.png").is_file() and (plots / "reward_accuracy.png").is_file()


def test_full_dpo_under_pp_learns_the_rule_with_its_reference_in_the_stages(
    tmp_path: Path,
) -> None:
    """The same rule on one pipeline of the 2 ranks (pp2): the separate reference is
    built in the policy's stages and says so in the run's first lines; 4 micro-batches
    of 8 pairs a step, 1F1B."""
    good = _write(tmp_path / "rule.jsonl", _rule_rows(320))
    done = fsdpkit(
        "train",
        *("train.objective=dpo", "train.sample_tokens=0", "logging.report=false", *MODEL),
        *(f"data.path={good}", f"logging.run_dir={tmp_path / 'pp'}", "parallel.pp=2"),
        *("train.steps=10", "train.global_batch_size=32", "train.micro_batch_size=8"),
        *("train.warmup_steps=5", "train.lr=5e-3", "train.schedule=constant", "dpo.beta=1.0"),
        *("data.seq_len=16", "data.val_fraction=0", "train.eval_every=0"),
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout + done.stderr
    assert (
        "reference: the policy's starting weights, frozen, sharded, float32, in the "
        "policy's pipeline stages" in first
    ), first[:3000]
    records = metrics(tmp_path / "pp")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[0]["rewards/accuracy"] == 0.0  # policy = reference: every reward is 0
    late = [r["rewards/accuracy"] for r in records[7:]]  # measured 0.94-1.0, margin 1.6
    assert sum(late) / len(late) > 0.85 and records[-1]["rewards/margin"] > 0.5, records
