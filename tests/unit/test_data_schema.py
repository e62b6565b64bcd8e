"""SFT schemas on rows shaped as TRL, Axolotl and LLaMA-Factory write them: detection,
role mapping, the exact loss mask, and the records that are refused (never trained as
their JSON text). Fixtures: tests/fixtures/data (README there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError
from fsdpkit.data.plan import data_kind
from fsdpkit.data.schemas import ALPACA_PROMPT
from fsdpkit.data.tokenizer import load_hf_tokenizer
from fsdpkit.data.work import load_examples

pytest.importorskip("transformers")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"
END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_hf import write_tokenizer

    out = tmp_path_factory.mktemp("chat-tok")
    write_tokenizer(out, vocab_size=320, chat=True)
    return out


def _load(path: Path | str, tokenizer: Path | None = None, **kw: Any) -> tuple[list, Any, Any]:
    cfg = DataConfig(path=str(path), tokenizer=str(tokenizer) if tokenizer else None, **kw)
    tok = load_hf_tokenizer(tokenizer) if tokenizer else ByteTokenizer()
    examples, schemas = load_examples(cfg, tok)
    return examples, schemas, tok


def _runs(tok: Any, ex: Any) -> list[str]:
    """The trained tokens of an example, decoded, one string per contiguous run."""
    runs, start = [], None
    for i, on in enumerate([*ex.train.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(tok.decode(ex.ids[start:i].tolist()))
            start = None
    return runs


def _text(tok: Any, ex: Any) -> str:
    return tok.decode(ex.ids.tolist())


def test_trl_standard_prompt_completion_mask_is_the_completion(chat_dir: Path) -> None:
    path = FIXTURES / "trl" / "standard_prompt_completion.jsonl"
    examples, schemas, tok = _load(path)
    assert dict(schemas) == {"prompt_completion": 3}
    assert [_runs(tok, ex) for ex in examples] == [[" blue."], [" yellow."], [" green."]]
    examples, _, tok = _load(path, chat_dir)  # an HF tokenizer adds EOS, trained too
    assert _runs(tok, examples[0]) == [" blue.<|endoftext|>"]


def test_trl_conversational_prompt_completion_trains_only_the_completion(chat_dir: Path) -> None:
    path = FIXTURES / "trl" / "conversational_prompt_completion.jsonl"
    examples, schemas, tok = _load(path, chat_dir)
    assert dict(schemas) == {"prompt_completion": 2}
    assert _runs(tok, examples[0]) == ["It is blue." + END]
    # the prompt's own assistant turn ("Yes.") is context, not a target
    assert _runs(tok, examples[1]) == ["No, 7 is odd." + END]
    assert _text(tok, examples[1]).startswith("<|im_start|>system\nAnswer briefly." + END)


def test_messages_train_every_assistant_turn(chat_dir: Path) -> None:
    path = FIXTURES / "trl" / "conversational_language_modeling.jsonl"
    examples, schemas, tok = _load(path, chat_dir)
    assert dict(schemas) == {"messages": 2}
    assert _runs(tok, examples[1]) == ["In the sky." + END, "Also in the sky." + END]


def test_sharegpt_tool_turns_map_to_assistant_and_tool(chat_dir: Path) -> None:
    path = FIXTURES / "llamafactory" / "glaive_toolcall_en_demo.json"
    examples, schemas, tok = _load(path, chat_dir)
    assert dict(schemas) == {"sharegpt": 2}
    call = (
        '{"name": "search_recipes", "arguments": {"ingredients": '
        '["chicken", "bell peppers", "rice"]}}'
    )
    assert _runs(tok, examples[0]) == [
        "Of course! I can help you with that. Please tell me what ingredients you have." + END,
        call + END,  # function_call: the assistant calling the tool, trained
        "I found a recipe for you: Chicken and Bell Pepper Stir Fry." + END,
    ]
    text = _text(tok, examples[0])  # observation: the tool's result, context only
    assert "<|im_start|>tool\n" in text and "<|im_start|>user\nHi, I have" in text


def test_sharegpt_system_field_and_single_object(chat_dir: Path) -> None:
    [ex], _, tok = _load(FIXTURES / "llamafactory" / "sharegpt_system.json", chat_dir)
    assert _text(tok, ex).startswith("<|im_start|>system\nYou are a geography tutor." + END)
    assert _runs(tok, ex) == ["Paris." + END]
    [ex], schemas, tok = _load(FIXTURES / "axolotl" / "conversation.json", chat_dir)
    assert dict(schemas) == {"sharegpt": 1}
    assert _text(tok, ex).startswith("<|im_start|>system\nYou are an AI assistant.")
    assert _runs(tok, ex) == ["Guten Morgen." + END, "Bonjour." + END]


def test_sharegpt_empty_user_turn_is_kept(chat_dir: Path) -> None:
    [ex], _, tok = _load(FIXTURES / "axolotl" / "conversation.missingturn.json", chat_dir)
    assert "<|im_start|>user\n" + END in _text(tok, ex)
    assert len(_runs(tok, ex)) == 2


def test_sharegpt_empty_reply_is_rendered_not_trained_and_counted(
    chat_dir: Path, tmp_path: Path
) -> None:
    """An empty assistant reply among others (axolotl's missingturns shape) stays in the
    text as the data has it, is not trained (it would teach stopping at once) and is
    counted in the prepared dataset's manifest, whose source line the run prints."""
    from fsdpkit.data.first_lines import source_line
    from fsdpkit.data.opened import open_source

    path = FIXTURES / "axolotl" / "conversation.missingturns.json"
    [ex], schemas, tok = _load(path, chat_dir)
    assert dict(schemas) == {"sharegpt": 1}
    assert "<|im_start|>assistant\n" + END + "<|im_start|>user\ncould you" in _text(tok, ex)
    assert _runs(tok, ex) == [
        "Treat the board as a space and read the mines off its invariants." + END,
        "A closed ring of numbered cells around unknown ones bounds a hole: count it." + END,
    ]
    cfg = DataConfig(path=str(path), tokenizer=str(chat_dir), val_fraction=0.0)
    opened, _ = open_source(cfg, work_dir=tmp_path)
    assert opened.dataset.manifest.counts["empty_replies"] == 1
    line = source_line(opened)
    assert "ShareGPT conversations (1 rows); 1 empty assistant reply not trained" in line


def test_alpaca_through_the_chat_template(chat_dir: Path) -> None:
    examples, schemas, tok = _load(FIXTURES / "llamafactory" / "alpaca_en_demo.json", chat_dir)
    assert dict(schemas) == {"alpaca": 3}
    user = "Summarize the text in one sentence.\n\nThe quick brown fox"
    assert _text(tok, examples[2]).startswith("<|im_start|>user\n" + user)
    assert _runs(tok, examples[2]) == ["A fox jumps over a calm dog." + END]


def test_alpaca_without_a_template_uses_the_alpaca_prompt() -> None:
    examples, _, tok = _load(FIXTURES / "llamafactory" / "alpaca_en_demo.json")
    no_input = ALPACA_PROMPT.format(
        paired="", instruction="Describe a process of making crepes.", input_block=""
    )
    assert _text(tok, examples[0]) == no_input + "Making crepes is an easy and delicious process."
    assert _runs(tok, examples[0]) == ["Making crepes is an easy and delicious process."]
    text = _text(tok, examples[2])
    assert "paired with an input" in text and "### Input:\nThe quick brown fox" in text


def test_mixed_jsonl_of_messages_sharegpt_and_a_tool_call(chat_dir: Path) -> None:
    examples, schemas, tok = _load(FIXTURES / "mixed" / "chat_tools.jsonl", chat_dir)
    assert dict(schemas) == {"messages": 2, "sharegpt": 1}
    assert _runs(tok, examples[1]) == ["7." + END]
    # the call (its content is empty in this template), then the reply; the result is not trained
    assert _runs(tok, examples[2]) == [END, "It is 21 degrees in Paris." + END]
    assert '"temperature": 21' in _text(tok, examples[2])


@pytest.mark.parametrize(
    "name",
    [
        "llamafactory/alpaca_en_demo.json",
        "llamafactory/glaive_toolcall_en_demo.json",
        "llamafactory/sharegpt_system.json",
        "axolotl/conversation.json",
        "axolotl/conversation.missingturn.json",
        "axolotl/conversation.missingturns.json",
        "mixed/chat_tools.jsonl",
        "trl/conversational_prompt_completion.jsonl",
    ],
)
def test_sft_files_are_never_text(name: str) -> None:
    assert data_kind(DataConfig(path=str(FIXTURES / name))) == "sft"


def test_text_records_are_text() -> None:
    for name in ("trl/standard_language_modeling.jsonl", "torchtitan/c4_test/data.json"):
        assert data_kind(DataConfig(path=str(FIXTURES / name))) == "text"


def test_qa_json_is_refused_with_its_keys_then_mapped() -> None:
    path = FIXTURES / "qa" / "questions.json"
    with pytest.raises(DataError, match=r"questions\.json: record 0: .*keys: 'question', 'answer'"):
        data_kind(DataConfig(path=str(path)))
    examples, schemas, tok = _load(path, columns=["prompt=question", "completion=answer"])
    assert dict(schemas) == {"prompt_completion": 2}
    assert _runs(tok, examples[1]) == ["Rome"]


def test_preference_rows_are_refused() -> None:
    with pytest.raises(DataError, match=r"preference\.jsonl:1: a preference row"):
        data_kind(DataConfig(path=str(FIXTURES / "trl" / "preference.jsonl")))


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"conversations": [{"from": "narrator", "value": "x"}]}, "role 'narrator'"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
            "no assistant message to train on \\(none, or only empty ones\\)",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role 'tool'"),
        ({"prompt": [{"role": "user", "content": "q"}], "completion": "a"}, "both be strings"),
        ({"instruction": "i", "output": " "}, "alpaca 'output' is empty"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, row: Any, needle: str, chat_dir: Path) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError, match=needle) as err:
        _load(path, chat_dir)
    assert f"{path}:2" in str(err.value)


def test_forced_schema_refuses_other_records(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"text": "t"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: data\.schema = 'prompt_completion' needs"):
        _load(path, schema="prompt_completion")


def test_text_record_among_sft_rows_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"text": "t"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: a plain-text record"):
        _load(path)


def test_first_token_is_never_a_target() -> None:
    examples, _, _ = _load(FIXTURES / "trl" / "standard_prompt_completion.jsonl")
    assert not any(ex.train[0] for ex in examples)
    assert all(isinstance(ex.ids, np.ndarray) for ex in examples)
