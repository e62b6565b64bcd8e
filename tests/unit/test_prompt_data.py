"""RL prompt rows (fsdpkit.data.prompts) and their order (fsdpkit.data.prompt_order):
every source the data layer reads, string and chat prompts tokenized as TRL 1.16's
GRPOTrainer does, columns for the rewards, refusals that name the file and the column,
and an order that is the same at every world size and resumes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError, PromptLoader, load_prompts, open_prompt_data
from fsdpkit.data.tokenizer import load_hf_tokenizer

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [
    {"prompt": "What is 2+3?", "answer": "5", "level": 1},
    {"prompt": "What is 7*6?", "answer": "42", "level": 2},
    {"prompt": "Name a prime.", "answer": "7", "level": 3},
]
CHAT = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2+3?"},
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_hf import write_tokenizer

    out = tmp_path_factory.mktemp("chat-tok")
    write_tokenizer(out, vocab_size=320, chat=True)
    return out


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, tokenizer: Path | None = None, **kw: Any) -> Any:
    cfg = DataConfig(
        path=str(path), tokenizer=str(tokenizer) if tokenizer else None, val_fraction=0.0
    )
    tok = load_hf_tokenizer(tokenizer) if tokenizer else ByteTokenizer()
    return load_prompts(cfg, tok, max_prompt_length=kw.pop("max_prompt_length", 512), **kw)


def _sources(tmp: Path) -> dict[str, Path]:
    """The same rows as jsonl, jsonl.gz, json, parquet, save_to_disk and a Hub layout."""
    datasets = pytest.importorskip("datasets")
    out = {"jsonl": _jsonl(tmp / "p.jsonl", ROWS)}
    out["gz"] = tmp / "p.jsonl.gz"
    out["gz"].write_bytes(gzip.compress(out["jsonl"].read_bytes()))
    out["json"] = tmp / "p.json"
    out["json"].write_text(json.dumps(ROWS))
    out["parquet"] = tmp / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), out["parquet"])
    out["arrow"] = tmp / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(out["arrow"]))
    hub = tmp / "hub"
    (hub / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), hub / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), hub / "data" / "test-00000-of-00001.parquet")
    out["hub"] = hub
    return out


def test_every_source_gives_the_same_prompts_and_columns(tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    for kind, path in sources.items():
        table = _load(path)
        assert [r.prompt for r in table.train] == [r["prompt"] for r in ROWS], kind
        assert [r.columns for r in table.train] == [
            {"answer": r["answer"], "level": r["level"]} for r in ROWS
        ], kind
        assert [r.row for r in table.train] == [0, 1, 2]
        first = table.train[0]
        assert bytes(first.ids.tolist()) == b"What is 2+3?" and first.text == "What is 2+3?"
        assert not first.conversational
    assert _load(sources["parquet"]).train[2].where.endswith("p.parquet: row 2")
    assert _load(sources["jsonl"]).train[2].where.endswith("p.jsonl:3")  # lines from 1


def test_string_and_chat_prompts_tokenize_as_trl(tmp_path: Path, chat_dir: Path) -> None:
    path = _jsonl(
        tmp_path / "mixed.jsonl",
        [{"prompt": "def add(a, b):", "solution": "x"}, {"prompt": CHAT, "solution": "5"}],
    )
    table = _load(path, chat_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    plain, chat = table.train
    # TRL 1.16 GRPOTrainer._tokenize_prompts: processing_class(text=prompts) for strings,
    # apply_chat_template(prompts, add_generation_prompt=True, tokenize=True) for chat
    assert plain.ids.tolist() == hf(text=["def add(a, b):"])["input_ids"][0]
    expected = hf.apply_chat_template([CHAT], add_generation_prompt=True, tokenize=True)
    assert chat.ids.tolist() == list(expected["input_ids"][0])
    assert chat.text.endswith("<|im_start|>assistant\n") and chat.conversational
    assert chat.prompt == CHAT  # rewards get the messages as the data has them
    assert table.formats == {"standard": 1, "conversational": 1}


def test_verl_nested_ground_truth_and_every_column_are_kept(tmp_path: Path, chat_dir: Path) -> None:
    row = {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0},
    }
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    cfg = DataConfig(path=str(path), val_fraction=0.0)
    with pytest.raises(DataError, match=r"data\.tokenizer is empty"):  # chat needs a template
        load_prompts(cfg, ByteTokenizer(), max_prompt_length=64)
    (got,) = _load(path, chat_dir, required={"math": ("answer", "ground_truth")}).train
    assert got.columns["ground_truth"] == "2" and got.prompt == row["prompt"]
    assert got.text.endswith("<|im_start|>assistant\n")
    assert got.columns["reward_model"] == row["reward_model"]
    assert got.columns["extra_info"] == row["extra_info"] and got.columns["ability"] == "math"


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        ({"question": "2+2?", "answer": "4"}, ["no 'prompt' column", "'question'", "data.columns"]),
        ({"prompt": "   ", "answer": "4"}, ["'prompt' is empty"]),
        ({"prompt": 7, "answer": "4"}, ["string or a list of chat messages", "int"]),
        ({"prompt": "2+2?", "final": "4"}, ["reward 'math'", "'answer' / 'ground_truth'",
                                             "'final'", "data.columns"]),
        ({"prompt": "2+2?", "answer": None}, ["reward 'math'"]),
        ({"prompt": "2+2?", "answer": "4", "completions": "x"}, ["'completions'", "Rename"]),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_the_line_and_the_column(
    tmp_path: Path, row: dict[str, Any], needles: list[str]
) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(DataError) as info:
        _load(path, required={"math": ("answer", "ground_truth", "solution")})
    message = str(info.value)
    assert f"{path}:2" in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_columns_are_renamed_and_the_rows_of_a_table_are_named(tmp_path: Path) -> None:
    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "final": "2"}] * 2), path)
    cfg = DataConfig(path=str(path), columns=["prompt=question"], val_fraction=0.0)
    with pytest.raises(DataError, match=r"q\.parquet: row 0: the reward 'exact'"):
        load_prompts(cfg, ByteTokenizer(), max_prompt_length=64, required={"exact": ("answer",)})
    cfg = DataConfig(path=str(path), columns=["prompt=question", "answer=final"])
    table = load_prompts(cfg, ByteTokenizer(), max_prompt_length=64, required={"x": ("answer",)})
    assert table.train[0].columns == {"answer": "2"}


def test_long_prompts_are_left_out_and_counted(tmp_path: Path) -> None:
    rows = [{"prompt": "x" * n} for n in (4, 30, 8, 50)]
    table = _load(_jsonl(tmp_path / "p.jsonl", rows), max_prompt_length=10)
    assert [r.row for r in table.train] == [0, 2] and table.too_long == 2
    note = table.describe(max_prompt_length=10)
    assert "2 prompts longer than rl.max_prompt_length = 10 tokens left out" in note
    assert "longest: 50" in note
    with pytest.raises(DataError, match=r"every prompt is longer than rl\.max_prompt_length = 3"):
        _load(_jsonl(tmp_path / "p.jsonl", rows), max_prompt_length=3)


def test_text_files_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just text")
    with pytest.raises(DataError, match="plain-text file; RL prompts are rows"):
        _load(text)


def _table(n: int) -> list[Any]:
    from fsdpkit.data.prompts import PromptRow

    return [PromptRow(i, f"f:{i}", str(i), str(i), np.asarray([i])) for i in range(n)]


def _steps(loader: PromptLoader, count: int) -> list[list[int]]:
    return [[r.row for r in loader.next_step().rows] for _ in range(count)]


def test_the_order_is_world_size_independent_and_wraps_epochs() -> None:
    rows = _table(23)  # 23 // 6 = 3 steps per epoch, 5 prompts dropped per epoch
    by_world = {}
    for world in (1, 2, 3, 6):
        loaders = [
            PromptLoader(rows, prompts_per_step=6, seed=5, dp_rank=r, dp_world=world)
            for r in range(world)
        ]
        steps = []
        for _ in range(7):
            batches = [ld.next_step() for ld in loaders]
            assert all((b.step_rows == batches[0].step_rows).all() for b in batches)
            assert [b.start for b in batches] == [r * 6 // world for r in range(world)]
            steps.append([r.row for b in batches for r in b.rows])
            assert steps[-1] == batches[0].step_rows.tolist()
        by_world[world] = steps
    assert by_world[1] == by_world[2] == by_world[3] == by_world[6]
    epoch0 = [i for s in by_world[1][:3] for i in s]
    assert len(set(epoch0)) == 18  # no prompt twice within an epoch
    assert by_world[1][3] != by_world[1][0]  # the next epoch is a fresh permutation
    other_seed = PromptLoader(rows, prompts_per_step=6, seed=6, dp_rank=0, dp_world=1)
    assert _steps(other_seed, 1)[0] != by_world[1][0]


def test_the_order_resumes_at_another_world_size() -> None:
    rows = _table(23)
    straight = PromptLoader(rows, prompts_per_step=6, seed=1, dp_rank=0, dp_world=1)
    expected = _steps(straight, 8)
    first = PromptLoader(rows, prompts_per_step=6, seed=1, dp_rank=1, dp_world=2)
    _steps(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state == {"epoch": 1, "consumed": 12}
    resumed = [
        PromptLoader(rows, prompts_per_step=6, seed=1, dp_rank=r, dp_world=3) for r in range(3)
    ]
    for loader in resumed:
        loader.load_state_dict(state)
    later = [
        [i for part in parts for i in part] for parts in zip(*[_steps(ld, 3) for ld in resumed])
    ]
    assert later == expected[5:]
    with pytest.raises(DataError, match="saved data position"):
        resumed[0].load_state_dict({"epoch": -1, "consumed": 0})


def test_a_step_must_split_evenly_and_fit_the_data() -> None:
    with pytest.raises(DataError, match="cannot be split evenly over 4 data-parallel ranks"):
        PromptLoader(_table(10), prompts_per_step=6, seed=0, dp_rank=0, dp_world=4)
    with pytest.raises(DataError, match=r"has 3 training prompts.*one step samples 4"):
        PromptLoader(_table(3), prompts_per_step=4, seed=0, dp_rank=0, dp_world=2)


def test_open_prompt_data_is_a_ranks_view(tmp_path: Path, chat_dir: Path) -> None:
    rows = [{"prompt": f"Q{i}?", "answer": str(i)} for i in range(40)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), tokenizer=str(chat_dir), val_fraction=0.1)
    opened = [
        open_prompt_data(
            cfg, max_prompt_length=64, prompts_per_step=8, seed=0, dp_rank=r, dp_world=2,
            required={"math": ("answer",)},
        )
        for r in range(2)
    ]  # fmt: skip
    data = opened[0]
    assert data.note is not None and "36 training prompts, 4 held out" in data.note
    assert "8 prompts per step (4 per data-parallel rank), 4 steps per epoch" in data.note
    assert data.record["prompts"] == 36 and data.tokenizer.eos_id == 0
    batch = data.loader.next_step()
    assert len(batch) == 4 and batch.positions.tolist() == [0, 1, 2, 3]
    assert [len(i) for i in batch.ids] == [len(r.ids) for r in batch.rows]
    assert [r.row for r in batch.repeat(2)][:2] == [batch.row_ids[0]] * 2
    (val0,), (val1,) = opened[0].val, opened[1].val
    assert [r.row for r in val0.rows + val1.rows] == [36, 37, 38, 39]
