"""Small and imperfect SFT data through ``fsdpkit train``, as users have it.

- Two alpaca rows at ``data.seq_len=512`` on 2 ranks pack into one row: the run is
  refused with a message that names ``data.pack=false`` (and the step size that fits),
  and trains with it.
- A ShareGPT conversation with one empty assistant reply (the shape of axolotl's
  ``conversation.missingturns.json`` fixture) trains on a Llama 3 style tokenizer: the
  first lines count the reply that is not trained and say where BOS and EOS come from.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import fsdpkit

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

FIXTURE = Path(__file__).parents[1] / "fixtures" / "data" / "axolotl"
MODEL = ["model.n_layers=2", "model.dim=64", "model.ffn_dim=128", "model.n_heads=4"]
RUN = ["train.steps=2", "train.sample_tokens=0", "logging.report=false", "train.warmup_steps=1"]


def test_two_alpaca_rows_name_data_pack_false_then_train(tmp_path: Path) -> None:
    rows = [
        {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Sleep."},
        {"instruction": "What are the three primary colors?", "input": "", "output": "Red."},
    ]
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(rows))
    args = ["train", f"data.path={data}", "data.seq_len=512", *MODEL, *RUN]
    refused = fsdpkit(*args, f"logging.run_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "packs into 1 rows of data.seq_len 512" in refused.stderr
    assert "set data.pack=false and train.global_batch_size=2" in refused.stderr
    trained = fsdpkit(
        *args,
        "data.pack=false",
        "train.global_batch_size=2",
        f"logging.run_dir={tmp_path / 'b'}",
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "2 examples one per row: 2 rows of 512" in trained.stdout


def test_sharegpt_with_an_empty_reply_trains_and_counts_it(tmp_path: Path) -> None:
    from tiny_hf import write_tiny_model

    from chat_tokenizers import write_chat_tokenizer

    model = write_tiny_model(tmp_path / "llama3", tokenizer=False, vocab_size=400, dim=32)
    write_chat_tokenizer(model, "llama3")
    run = fsdpkit(
        "train",
        f"model.hf={model}",
        f"data.path={FIXTURE / 'conversation.missingturns.json'}",
        "data.seq_len=256",
        "data.val_fraction=0",
        "train.global_batch_size=1",
        f"logging.run_dir={tmp_path / 'run'}",
        *RUN,
        "--nproc",
        "1",
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "ShareGPT conversations (1 rows); 1 empty assistant reply not trained" in out
    assert "bos: added by the tokenizer (<|begin_of_text|>)" in out
    assert "eos: appended (<|eot_id|>)" in out
    assert "chat rows: as the chat template writes them" in out
