"""fsdpkit's tokens and DPO metrics against TRL 1.16's own preprocessing and DPOTrainer.

On a Llama 3 style tokenizer (BOS on encode; its template writes BOS itself) and a
ChatML / Qwen2.5 style one (no BOS), both from tests/chat_tokenizers.py, every schema's
token ids and trained-token masks are compared with what TRL's ``SFTTrainer`` /
``DPOTrainer`` make of the same rows (their preprocessed ``train_dataset``, options
named in each test). Where fsdpkit differs on purpose the difference is the one
docs/data.md ("Tokens compared with TRL") documents, and is asserted as exactly that.

Masks are compared from position 1: position 0 is never a target (fsdpkit marks it
untrained; TRL's labels are shifted, so its label 0 is never used). The DPO and IPO
tests run one real ``DPOTrainer.compute_loss`` on a tiny Llama (policy and reference
from different seeds, so the rewards are not zero) and fsdpkit's ``DpoLoss`` on the
same rows, and compare the loss and the logged rewards. TRL configs autocast to bf16
by default, even on CPU: every config here sets ``bf16=False``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from chat_tokenizers import CHAT, KINDS, write_chat_tokenizer
from fsdpkit.config import DataConfig, load
from fsdpkit.data import load_token_stream
from fsdpkit.data.preference import load_pairs
from fsdpkit.data.tokenizer import HFTokenizer, load_hf_tokenizer
from fsdpkit.data.work import load_examples

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
import trl  # noqa: E402  (the dev extra: the oracle never skips)

USER = {"role": "user", "content": "Is 4 even?"}
YES, NO = {"role": "assistant", "content": "Yes."}, {"role": "assistant", "content": "No."}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {kind: write_chat_tokenizer(root / kind, kind) for kind in KINDS}


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _model(vocab: int, seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,  # far from uniform: log-ratios of O(1), not float noise
    )
    return transformers.LlamaForCausalLM(config)


def _trl_args(config: Any, tmp: Path, **kw: Any) -> Any:
    return config(output_dir=str(tmp / "trl"), bf16=False, use_cpu=True, report_to=[], **kw)


def _hf(directory: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def trl_sft(rows: list[Any], directory: Path, tmp: Path, **kw: Any) -> list[tuple[list, list]]:
    """(ids, trained mask) of each row after SFTTrainer's preprocessing."""
    hf = _hf(directory)
    args = _trl_args(trl.SFTConfig, tmp, max_length=None, **kw)
    trainer = trl.SFTTrainer(
        model=_model(len(hf), 0),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=hf,
    )
    data = trainer.train_dataset
    return [(r["input_ids"], [x != -100 for x in r["labels"]]) for r in data]


def fsdpkit_sft(rows: list[Any], directory: Path, tmp: Path) -> list[tuple[list, list]]:
    path = _jsonl(tmp / "rows.jsonl", rows)
    cfg = DataConfig(path=path, tokenizer=str(directory), format="sft")
    examples, _ = load_examples(cfg, load_hf_tokenizer(directory))
    return [(ex.ids.tolist(), ex.train.tolist()) for ex in examples]


def _one_eos(ids: list[int], tok: HFTokenizer) -> None:
    assert ids[-2:] != [tok.eos_id] * 2, "a row ends with two EOS tokens"


def assert_same(mine: list[tuple[list, list]], theirs: list[tuple[list, list]]) -> None:
    assert len(mine) == len(theirs)
    for (ids, train), (trl_ids, trl_train) in zip(mine, theirs):
        assert ids == trl_ids
        assert train[1:] == trl_train[1:]


def _talk(user: str, assistant: str) -> list[dict[str, str]]:
    return [{"from": user, "value": "Is 4 even?"}, {"from": assistant, "value": "Yes."}]


@pytest.mark.parametrize("schema", ["messages", "sharegpt"])
@pytest.mark.parametrize("kind", KINDS)
def test_conversations_match_trl_assistant_only_loss(
    tok_dirs: dict[str, Path], tmp_path: Path, kind: str, schema: str
) -> None:
    """SFTTrainer(assistant_only_loss=True) swaps in TRL's training template (ShareGPT
    rows with user/assistant roles through TRL's ``maybe_convert_to_chatml`` first:
    SFTTrainer refuses assistant_only_loss on from/value rows). Llama 3: equal. ChatML
    (convention): TRL's Qwen2.5 training template also trains the newline after
    ``<|im_start|>assistant``; fsdpkit's span starts after the generation prompt
    (``<|im_start|>assistant\\n``), which is what the model is given at inference."""
    if schema == "messages":
        rows: list[Any] = [{"messages": CHAT}, {"messages": [USER, YES]}]
        converted = rows
    else:
        talk = _talk("user", "assistant")
        rows = [{"conversations": talk}, {"conversations": [*talk, *talk]}]
        convert = trl.data_utils.maybe_convert_to_chatml
        converted = [convert(json.loads(json.dumps(r))) for r in rows]
    mine = fsdpkit_sft(rows, tok_dirs[kind], tmp_path)
    theirs = trl_sft(converted, tok_dirs[kind], tmp_path, assistant_only_loss=True)
    if kind == "llama3":
        assert_same(mine, theirs)
        assert all(ids.count(0) == 1 for ids, _ in mine)  # the template's BOS, once
        return
    newline = _hf(tok_dirs[kind]).encode("\n", add_special_tokens=False)
    for (ids, train), (trl_ids, trl_train) in zip(mine, theirs):
        assert ids == trl_ids
        extra = [i for i in range(1, len(ids)) if trl_train[i] and not train[i]]
        assert not [i for i in range(1, len(ids)) if train[i] and not trl_train[i]]
        assert [ids[i] for i in extra] == newline * len(extra)
        assert all(train[i + 1] and not train[i - 1] for i in extra)  # right before a reply
        replies = sum(1 for i in range(1, len(ids)) if train[i] and not train[i - 1])
        assert len(extra) == replies


@pytest.mark.parametrize("kind", KINDS)
def test_sharegpt_roles_are_mapped_where_trl_keeps_them(
    tok_dirs: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Convention: ShareGPT's ``human`` / ``gpt`` become ``user`` / ``assistant`` in
    fsdpkit (ids equal to TRL's on rows written with those roles); TRL renders the role
    names as written (so its templates see no assistant turn to mask)."""
    rows = [{"conversations": _talk("human", "gpt")}]
    mapped = [{"conversations": _talk("user", "assistant")}]
    mine = fsdpkit_sft(rows, tok_dirs[kind], tmp_path)
    assert mine == fsdpkit_sft(mapped, tok_dirs[kind], tmp_path)
    [(trl_ids, _)] = trl_sft(rows, tok_dirs[kind], tmp_path)
    hf = _hf(tok_dirs[kind])
    verbatim = [{"role": m["from"], "content": m["value"]} for m in _talk("human", "gpt")]
    text = hf.apply_chat_template(verbatim, tokenize=False)
    assert trl_ids == hf(text, add_special_tokens=False)["input_ids"] != mine[0][0]


@pytest.mark.parametrize("kind", KINDS)
def test_conversational_prompt_completion_matches_trl(
    tok_dirs: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """SFTTrainer's completion-only loss on conversational prompt/completion: equal (the
    prompt is rendered with the generation prompt on both sides)."""
    rows = [
        {"prompt": [USER], "completion": [YES]},
        {"prompt": CHAT[:4], "completion": [CHAT[4]]},
    ]
    assert_same(
        fsdpkit_sft(rows, tok_dirs[kind], tmp_path), trl_sft(rows, tok_dirs[kind], tmp_path)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_string_prompt_completion_matches_trl(
    tok_dirs: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Prompts that end on a token boundary: equal ids and masks, the tokenizer's BOS
    first (Llama 3) and one EOS, also after a completion that already ends with it."""
    tok = load_hf_tokenizer(tok_dirs[kind])
    eos = tok.decode([tok.eos_id])  # type: ignore[list-item]
    rows = [
        {"prompt": "Question: what is 2+2?\nAnswer:", "completion": " 4"},
        {"prompt": "Is 4 even?", "completion": " Yes." + eos},
        {"prompt": "", "completion": "Hello world"},
    ]
    mine = fsdpkit_sft(rows, tok_dirs[kind], tmp_path)
    assert_same(mine, trl_sft(rows, tok_dirs[kind], tmp_path))
    for ids, _ in mine:
        _one_eos(ids, tok)
        assert ids[: len(tok.bos_ids)] == list(tok.bos_ids)
    assert tok.bos_ids == ((0,) if kind == "llama3" else ())


def test_string_prompt_completion_conventions(tok_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The documented differences, each exactly as documented:

    - prompt and completion tokenized separately: a prompt ending with a space or in
      the middle of a word gives other ids than TRL's (which tokenizes prompt +
      completion as one string and trains from where it diverges from the prompt);
      fsdpkit's answer is exactly the completion's tokens and the EOS;
    - a prompt that already starts with the BOS text keeps one BOS (TRL's has two)."""
    directory = tok_dirs["llama3"]
    tok, hf = load_hf_tokenizer(directory), _hf(directory)
    rows = [
        {"prompt": "Question: what is 2+2?\nAnswer: ", "completion": "4"},
        {"prompt": "Say: Hel", "completion": "lo world"},
        {"prompt": "<|begin_of_text|>Is 4 even?", "completion": " Yes."},
    ]
    mine = fsdpkit_sft(rows, directory, tmp_path)
    theirs = trl_sft(rows, directory, tmp_path)
    for row, (ids, train), (trl_ids, trl_train) in zip(rows, mine, theirs):
        prompt = tok.encode(row["prompt"])
        prompt = prompt if prompt[:1] == [0] else [0, *prompt]
        answer = [*tok.encode(row["completion"]), tok.eos_id]
        assert ids == prompt + answer and train == [False] * len(prompt) + [True] * len(answer)
        joined = row["prompt"] + row["completion"]
        assert trl_ids == hf(joined + "<|eot_id|>")["input_ids"] != ids
        start = trl_train.index(True)
        assert trl_ids[:start] == hf(row["prompt"])["input_ids"][:start]
    assert theirs[2][0][:2] == [0, 0] and mine[2][0][:2] == [0, tok.encode("Is")[0]]


def test_a_tokenizer_that_appends_eos_itself_still_gives_one(
    tok_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Convention: a tokenizer whose encode appends EOS itself (post-processor
    ``BOS $A EOS``): TRL appends the EOS text too, so its rows end with two EOS;
    fsdpkit's with one (otherwise equal)."""
    from tokenizers import Tokenizer, processors

    directory = tmp_path / "adds-eos"
    shutil.copytree(tok_dirs["llama3"], directory)
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        special_tokens=[(bos, raw.token_to_id(bos)), (eos, raw.token_to_id(eos))],
    )
    raw.save(str(directory / "tokenizer.json"))
    tok = load_hf_tokenizer(directory)
    rows = [{"prompt": "Is 4 even?", "completion": " Yes."}]
    [(ids, train)] = fsdpkit_sft(rows, directory, tmp_path)
    [(trl_ids, trl_train)] = trl_sft(rows, directory, tmp_path)
    assert tok.bos_ids == (0,) and ids[0] == 0
    assert trl_ids[-2:] == [tok.eos_id] * 2 and trl_ids[:-1] == ids
    assert trl_train[1:-1] == train[1:]
    _one_eos(ids, tok)


def test_an_empty_reply_is_not_trained_where_trl_trains_its_end_of_turn(
    tok_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Convention: an empty assistant reply among others is rendered but not trained
    (fsdpkit would otherwise teach stopping at once); TRL's assistant mask covers its
    end-of-turn token. Everything else equal."""
    rows = [{"messages": [USER, {"role": "assistant", "content": ""}, USER, YES]}]
    [(ids, train)] = fsdpkit_sft(rows, tok_dirs["llama3"], tmp_path)
    [(trl_ids, trl_train)] = trl_sft(rows, tok_dirs["llama3"], tmp_path, assistant_only_loss=True)
    assert ids == trl_ids
    extra = [i for i in range(1, len(ids)) if trl_train[i] != train[i]]
    eot = load_hf_tokenizer(tok_dirs["llama3"]).eos_id
    assert [ids[i] for i in extra] == [eot] and trl_train[extra[0]]


@pytest.mark.parametrize("kind", KINDS)
def test_text_rows_match_trl(tok_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """Plain text rows: SFTTrainer's language-modeling rows are ``BOS + text + EOS``
    (EOS unless the text ends with it), every token trained; a prepared text stream
    is those rows back to back."""
    tok = load_hf_tokenizer(tok_dirs[kind])
    eos = tok.decode([tok.eos_id])  # type: ignore[list-item]
    rows = [{"text": "Hello world."}, {"text": "Is 4 even? Yes." + eos}, {"text": "The dog."}]
    theirs = trl_sft(rows, tok_dirs[kind], tmp_path)
    path = _jsonl(tmp_path / "text.jsonl", rows)
    stream = load_token_stream(DataConfig(path=path, tokenizer=str(tok_dirs[kind])), tok)
    assert stream.tolist() == [t for ids, _ in theirs for t in ids]
    assert all(all(train) for _, train in theirs)
    for ids, _ in theirs:
        _one_eos(ids, tok)


def _pairs(directory: Path, rows: list[Any], tmp: Path, *extra: str) -> Any:
    path = _jsonl(tmp / "pairs.jsonl", rows)
    overrides = ["train.objective=dpo", f"data.path={path}", f"data.tokenizer={directory}"]
    cfg = load(None, [*overrides, "data.seq_len=128", "data.val_fraction=0", *extra])
    return cfg, load_pairs(cfg.data, load_hf_tokenizer(directory))


def trl_dpo(rows: list[Any], directory: Path, tmp: Path, *, models: Any = None, **kw: Any) -> Any:
    hf = _hf(directory)
    policy, reference = models or (_model(len(hf), 0), _model(len(hf), 1))
    return trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=_trl_args(trl.DPOConfig, tmp, per_device_train_batch_size=len(rows), **kw),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=hf,
    )


PREFERENCES = {
    "standard": [
        {"prompt": "Question: what is 2+2?\nAnswer:", "chosen": " 4", "rejected": " 5"},
        {"prompt": "Is 4 even?", "chosen": " Yes.<EOS>", "rejected": " No."},
    ],
    "conversational": [
        {"prompt": [USER], "chosen": [YES], "rejected": [NO]},
        {"prompt": CHAT[:4], "chosen": [CHAT[4]], "rejected": [NO]},
    ],
    "implicit prompt": [
        {"chosen": [USER, YES], "rejected": [USER, NO]},
        {"chosen": CHAT, "rejected": [*CHAT[:4], NO]},
    ],
}


def _rows(form: str, tok: HFTokenizer) -> list[Any]:
    text = json.dumps(PREFERENCES[form]).replace("<EOS>", tok.decode([tok.eos_id]))  # type: ignore[list-item]
    return list(json.loads(text))


@pytest.mark.parametrize("form", list(PREFERENCES))
@pytest.mark.parametrize("kind", KINDS)
def test_preference_rows_match_trl(
    tok_dirs: dict[str, Path], tmp_path: Path, kind: str, form: str
) -> None:
    """DPOTrainer's prompt / chosen / rejected ids: each fsdpkit side is ``prompt_ids +
    side_ids`` with exactly the side trained (one EOS on string sides, BOS as the
    tokenizer adds it)."""
    tok = load_hf_tokenizer(tok_dirs[kind])
    rows = _rows(form, tok)
    data = trl_dpo(rows, tok_dirs[kind], tmp_path).train_dataset
    _, pairs = _pairs(tok_dirs[kind], rows, tmp_path)
    for i, row in enumerate(data):
        for k, side in enumerate(("chosen_ids", "rejected_ids")):
            ids, train = pairs.train.side(2 * i + k)
            prompt = row["prompt_ids"]
            assert ids.tolist() == prompt + row[side]
            assert train[1:].tolist() == [False] * (len(prompt) - 1) + [True] * len(row[side])
            if form == "standard":
                _one_eos(ids.tolist(), tok)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_and_ipo_step_match_trl(tok_dirs: dict[str, Path], tmp_path: Path, loss: str) -> None:
    """One step's loss and logged rewards on the same rows (Llama 3 style tokenizer:
    the rows start with BOS on both sides) within 1e-5 relative; the reward accuracy
    equal. The rewards are beta x the summed log-ratio for IPO too, as TRL logs them."""
    from fsdpkit.trainable.reference import DpoLoss

    directory = tok_dirs["llama3"]
    tok = load_hf_tokenizer(directory)
    rows = [
        *_rows("standard", tok),
        {"prompt": "The quick brown fox", "chosen": " jumps.", "rejected": " sat on a dog."},
        {"prompt": "Hello", "chosen": " world, this is it.", "rejected": " you"},
    ]
    vocab = len(_hf(directory))
    trainer = trl_dpo(rows, directory, tmp_path, beta=0.1, loss_type=[loss])
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trl_loss = float(trainer.compute_loss(trainer.model, batch))
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    cfg, pairs = _pairs(directory, rows, tmp_path, f"dpo.loss={loss}", "dpo.beta=0.1")
    fn = DpoLoss(cfg.dpo, reference=_model(vocab, 1).eval(), lora=False, mesh=None)
    mine = float(fn(_model(vocab, 0).train(), pairs.train.take(np.arange(len(rows)))))
    metrics = fn.step_metrics()

    pairs_of_names = {
        "rewards/chosen": "rewards/chosen",
        "rewards/rejected": "rewards/rejected",
        "rewards/margin": "rewards/margins",
    }
    assert abs(mine - trl_loss) <= 1e-5 * abs(trl_loss)
    for ours, theirs in pairs_of_names.items():
        assert abs(metrics[ours] - logged[theirs]) <= 1e-5 * abs(logged[theirs]), ours
    assert metrics["rewards/accuracy"] == logged["rewards/accuracies"]
    assert 0 < logged["rewards/accuracies"] < 1  # the rows tell the sides apart both ways
