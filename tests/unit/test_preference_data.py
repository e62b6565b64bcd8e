"""Preference rows -> pairs -> micro-batches, and the preference losses, in one process.

With the byte tokenizer (id = byte, no EOS) the expected ids and answer masks are
written out by hand: a standard row trains exactly the answer of each side;
conversational and implicit-prompt rows (TRL) put the shared messages in the prompt;
pairs are rows 2i / 2i + 1 of one batch, right-padded; long sides are cut and counted;
bad rows (a missing side, identical sides, an empty answer, a prompt filling
data.seq_len) are one DataError naming the file and line. The losses are checked
against their formulas on numbers small enough to do by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fsdpkit.config import load
from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.data.errors import DataError
from fsdpkit.data.preference import load_pairs, pair_of
from fsdpkit.data.tokenizer import ByteTokenizer
from fsdpkit.errors import ConfigError
from fsdpkit.loss.dpo import answer_logps, preference_loss


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(path: Path, seq_len: int = 16) -> Any:
    cfg = load(None, ["train.objective=dpo", f"data.path={path}", f"data.seq_len={seq_len}"])
    return load_pairs(cfg.data, ByteTokenizer())


def test_standard_rows_train_each_answer_and_eos_in_adjacent_rows(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"prompt": "ab", "chosen": "cd", "rejected": "e"}] * 2)
    data = _data(path, seq_len=8)
    assert len(data.train) == 2 and data.val is None and data.truncated == 0
    batch = data.train.take(np.array([1]))
    a, b, c, d, e = (ord(x) for x in "abcde")
    no = IGNORE_INDEX  # the byte tokenizer has no EOS: nothing is appended, padding is 0
    assert batch.inputs.tolist() == [[a, b, c] + [0] * 5, [a, b] + [0] * 6]
    assert batch.targets.tolist() == [[no, c, d] + [no] * 5, [no, e] + [no] * 6]


def test_conversational_and_implicit_prompt_rows() -> None:
    user = {"role": "user", "content": "hi"}
    yes, nope = {"role": "assistant", "content": "yes"}, {"role": "assistant", "content": "no"}
    chosen, rejected = pair_of({"prompt": [user], "chosen": [yes], "rejected": [nope]}, where="w")
    assert chosen.messages == [user, yes] and chosen.train_from == 1
    assert rejected.messages == [user, nope] and rejected.train_from == 1
    implicit = pair_of({"chosen": [user, yes], "rejected": [user, nope]}, where="w")
    assert [c.train_from for c in implicit] == [1, 1]
    assert implicit[0].messages == chosen.messages and implicit[1].messages == rejected.messages


def test_a_long_side_is_cut_and_counted_and_a_full_prompt_is_refused(tmp_path: Path) -> None:
    long = _write(tmp_path / "long.jsonl", [{"prompt": "p", "chosen": "c" * 30, "rejected": "r"}])
    data = _data(long, seq_len=8)
    assert data.truncated == 1 and "1 pairs have a side longer" in data.describe(
        load(None, ["data.seq_len=8"]).data
    )
    assert data.train.take(np.array([0])).inputs.shape == (2, 8)
    full = _write(tmp_path / "full.jsonl", [{"prompt": "p" * 20, "chosen": "c", "rejected": "r"}])
    with pytest.raises(DataError, match=r"full\.jsonl:1: the 'chosen' side's prompt fills"):
        _data(full, seq_len=8)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "p", "chosen": "c"}, "has no 'rejected'"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "are identical"),
        ({"prompt": "p", "chosen": "c", "rejected": "  "}, "the 'rejected' answer is empty"),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
                "rejected": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
            },
            "the 'chosen' answer is empty",
        ),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, row: dict[str, Any], says: str) -> None:
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = _write(tmp_path / "bad.jsonl", [good, good, row])
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: .*{says}"):
        _data(path)


def test_config_refuses_what_would_be_ignored() -> None:
    with pytest.raises(ConfigError, match=r"dpo\.reference"):
        load(None, ["train.objective=dpo", "data.path=x", "dpo.reference=/m", "lora.rank=4"])
    with pytest.raises(ConfigError, match=r"data\.path"):
        load(None, ["train.objective=dpo"])
    with pytest.raises(ConfigError, match=r"dpo\.beta"):
        load(None, ["dpo.beta=0"])


def test_losses_follow_their_formulas() -> None:
    policy = torch.tensor([-2.0, -6.0, -3.0, -3.0])  # pairs (c, r): (-2, -6), (-3, -3)
    ref = torch.tensor([-3.0, -5.0, -3.0, -4.0])
    counts = torch.tensor([2.0, 4.0, 1.0, 3.0])
    out = preference_loss(policy, ref, counts, kind="sigmoid", beta=0.5)
    # margins: ((-2+3) - (-6+5)) = 2 and ((-3+3) - (-3+4)) = -1
    want = [math.log1p(math.exp(-0.5 * 2)), math.log1p(math.exp(0.5))]
    assert out.losses.tolist() == pytest.approx(want)
    assert out.chosen_rewards.tolist() == pytest.approx([0.5, 0.0])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.5, 0.5])
    ipo = preference_loss(policy, ref, counts, kind="ipo", beta=0.5)
    # length-averaged margins: (-1 + 1.5) - (-1.5 + 1.25) = 0.75 and (-3 + 3) - (-1 + 4/3)
    m = [0.75, -1.0 / 3.0]
    assert ipo.losses.tolist() == pytest.approx([(x - 1.0) ** 2 for x in m])
    # IPO's rewards are TRL's: beta x the summed log-ratio, as DPO's (the loss alone
    # averages over the answer's tokens), so the accuracy and margin read as TRL's
    assert ipo.chosen_rewards.tolist() == pytest.approx([0.5, 0.0])
    assert ipo.rejected_rewards.tolist() == pytest.approx([-0.5, 0.5])
    simpo = preference_loss(policy, None, counts, kind="simpo", beta=2.0, gamma=0.5)
    # 2 * (-1 - (-1.5)) - 0.5 = 0.5 and 2 * (-3 - (-1)) - 0.5 = -4.5
    assert simpo.losses.tolist() == pytest.approx(
        [math.log1p(math.exp(-0.5)), math.log1p(math.exp(4.5))]
    )
    # SimPO (reference-free) logs beta x the averaged log-prob, as TRL's CPOTrainer
    assert simpo.chosen_rewards.tolist() == pytest.approx([-2.0, -6.0])
    assert simpo.rejected_rewards.tolist() == pytest.approx([-3.0, -2.0])


def test_answer_logps_sum_only_the_answer_positions() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    targets = torch.tensor([[IGNORE_INDEX, 0, 1]])
    total, count = answer_logps(logits, targets)
    assert total.item() == pytest.approx(math.log(0.9) + math.log(0.8))
    assert count.item() == 2
