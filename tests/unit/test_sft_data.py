"""SFT data: formatting, the loss mask, packing, the loader, bad rows (no process group).

The packed-vs-unpacked check runs real models in one process: a token's loss must not
depend on the other examples packed into its row (fsdpkit's Llama, HF Llama, GPT-2).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from chat_tokenizers import CHAT
from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError
from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.data.packing import pack
from fsdpkit.data.schemas import Conversation
from fsdpkit.data.sft import Example, Formatter, is_sft
from fsdpkit.data.sft_loader import SFTLoader, load_sft
from fsdpkit.data.tokenizer import load_hf_tokenizer
from fsdpkit.data.work import load_examples
from fsdpkit.loss.answers import sft_loss, token_losses

transformers = pytest.importorskip("transformers")


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_hf import write_tokenizer

    out = tmp_path_factory.mktemp("chat-tok")
    write_tokenizer(out, vocab_size=320, chat=True)
    return out


def test_prompt_completion_mask_is_exactly_the_answer(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?\n", "completion": "4!"}])
    cfg = DataConfig(path=path, seq_len=12, format="sft")
    assert is_sft(DataConfig(path=path))  # auto-detected from the first row
    [ex], stats = load_examples(cfg, ByteTokenizer())
    assert stats == {"prompt_completion": 1} and bytes(ex.ids.tolist()) == b"Q: 2+2?\n4!"
    rows, _ = pack([ex], seq_len=12, pad_id=0, packed=False)
    batch = rows.take(torch.tensor([0]))
    # inputs are the first 12 of 13 tokens; the target at position t is token t + 1
    # where it is an answer token: '4' (predicted from '\n') and '!' (from '4'), no EOS
    # (the byte tokenizer has none), padding never
    expected = [IGNORE_INDEX] * 12
    expected[7], expected[8] = ord("4"), ord("!")
    assert batch.targets[0].tolist() == expected
    assert bytes(batch.inputs[0, :10].tolist()) == b"Q: 2+2?\n4!"
    assert batch.target_count() == 2


def test_eos_is_a_target_with_an_hf_tokenizer(tmp_path: Path, chat_dir: Path) -> None:
    """One EOS, a target, after every completion: also after one that already ends with
    the EOS text (no second EOS), in the batched prepare path as in the per-row one."""
    rows = [
        {"prompt": "def f():", "completion": " return 1"},
        {"prompt": "def f():", "completion": " return 1<|endoftext|>"},
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    tok = load_hf_tokenizer(chat_dir)
    examples, _ = load_examples(DataConfig(path=path, format="sft"), tok)
    for ex in examples:
        answer = ex.ids[ex.train]
        assert tok.decode(answer.tolist()) == " return 1<|endoftext|>"
        assert answer[-1] == tok.eos_id and not ex.train[: len(tok.encode("def f():"))].any()
    formatter = Formatter(tokenizer=tok, tokenizer_path=None, data_path=path)
    block = formatter.block(
        [Conversation("prompt_completion", plain=(r["prompt"], r["completion"])) for r in rows],
        [0, 1],
    )
    assert block.ids.tolist() == examples[0].ids.tolist() * 2
    assert block.train.tolist() == examples[0].train.tolist() * 2


def test_chat_rows_format_as_apply_chat_template(tmp_path: Path, chat_dir: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    cfg = DataConfig(path=path, tokenizer=str(chat_dir / "tokenizer.json"))
    assert is_sft(cfg)
    [ex], stats = load_examples(cfg, load_hf_tokenizer(chat_dir))
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    assert ex.ids.tolist() == list(hf.apply_chat_template(CHAT, tokenize=True)["input_ids"])
    assert stats == {"messages": 1}
    # the answer tokens are the assistant replies with their end-of-turn marker, no more
    runs, start = [], None
    for i, on in enumerate([*ex.train.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(hf.decode(ex.ids[start:i].tolist()))
            start = None
    assert runs == ["Yes.<|im_end|>\n", "No, 7 is odd.<|im_end|>\n"]


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"messages": [{"role": "narrator", "content": "hi"}]}, "role 'narrator'"),
        ({"prompt": "Q", "completion": "  "}, "the completion is empty"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"question": "Q", "answer": "A"}, "matches no data schema .*'question', 'answer'"),
    ],
)
def test_bad_rows_name_the_line_and_the_fix(tmp_path: Path, row: Any, needle: str) -> None:
    good = {"prompt": "a", "completion": "b"}
    path = _jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError, match=needle) as err:
        load_examples(DataConfig(path=path, format="sft"), ByteTokenizer())
    assert f"{path}:2" in str(err.value)


def test_chat_without_template_is_refused(tmp_path: Path) -> None:
    from tiny_hf import write_tokenizer

    write_tokenizer(tmp_path, vocab_size=300)  # no chat_template
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    for tokenizer in (str(tmp_path), None):
        cfg = DataConfig(path=path, tokenizer=tokenizer)
        with pytest.raises(DataError, match="chat template") as err:
            load_examples(cfg, ByteTokenizer())
        assert "prompt/completion" in str(err.value)


def _examples(lengths: list[int]) -> list[Example]:
    out = []
    for i, n in enumerate(lengths):
        ids = torch.arange(n) % 50 + 10 * i
        train = torch.zeros(n, dtype=torch.bool)
        train[max(1, n // 4) :] = True
        out.append(Example(ids=ids.numpy(), train=train.numpy()))
    return out


def test_packing_truncates_counts_and_restarts_positions() -> None:
    examples = _examples([5, 4, 20, 6, 3])
    rows, stats = pack(examples, seq_len=9, pad_id=0, packed=True)  # rows of 10 tokens
    assert (stats.examples, stats.truncated, stats.dropped) == (5, 1, 0)
    assert len(rows) == 3  # [5 + 4 + pad], [20 cut to 10], [6 + 3 + pad]
    positions = rows.take(torch.arange(3)).positions
    assert positions is not None  # the inputs' positions: the row's first seq_len
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert positions[2].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    batch = rows.take(torch.tensor([0]))
    # no target across the boundary: the first token of the second example is not one
    assert batch.targets[0, 4] == IGNORE_INDEX
    unpacked, stats = pack(examples, seq_len=9, pad_id=0, packed=False)
    assert len(unpacked) == 5 and unpacked.take(torch.arange(5)).positions is None
    prompt_only = [Example(ids=torch.arange(30).numpy(), train=(torch.arange(30) > 20).numpy())]
    _, stats = pack(prompt_only, seq_len=9, pad_id=0, packed=True)
    assert (stats.truncated, stats.dropped) == (1, 1)


def test_loader_regroups_rows_across_world_sizes_with_equal_weighting() -> None:
    rows, _ = pack(_examples([7, 3, 9, 4, 8, 2, 6, 5] * 4), seq_len=11, pad_id=0, packed=True)

    def draw(world: int, micro: int, steps: int) -> list[list[Any]]:
        loaders = [
            SFTLoader(rows, seq_len=11, micro_batch_size=micro, dp_rank=r, dp_world=world, seed=1)
            for r in range(world)
        ]
        return [[ld.next_batch() for ld in loaders] for _ in range(steps)]

    for two, one in zip(draw(2, 2, 3), draw(1, 4, 3)):
        assert torch.equal(torch.cat([b.inputs for b in two]), one[0].inputs)
        # every rank divides by the same share of the step's answer tokens
        assert two[0].normalizer == two[1].normalizer == one[0].normalizer / 2


def test_too_little_sft_data_is_one_paragraph(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    data = load_sft(DataConfig(path=path, seq_len=8, val_fraction=0.0, pack=False), ByteTokenizer())
    with pytest.raises(DataError, match="fewer than one step needs"):
        SFTLoader(data.train, seq_len=8, micro_batch_size=2, dp_rank=0, dp_world=2, seed=0)


def test_too_few_packed_rows_name_data_pack_false(tmp_path: Path) -> None:
    """Two small rows pack into one row of data.seq_len 512: too few for a step on two
    ranks; unpacked they are two rows, a step of 2, so the message names the fix."""
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "Q", "completion": "A"}] * 2)
    cfg = DataConfig(path=path, seq_len=512, val_fraction=0.0)
    packed = load_sft(cfg, ByteTokenizer())
    for batch, fix in (
        (4, "data.pack=false and train.global_batch_size=2"),
        (1, "set data.pack=false"),
    ):
        with pytest.raises(DataError, match="packs into 1 rows") as err:
            SFTLoader(
                packed.train, seq_len=512, micro_batch_size=batch, dp_rank=0, dp_world=2, seed=0
            )
        assert "each of the 2 examples gets a row of its own" in str(err.value) and fix in str(
            err.value
        )
    unpacked = load_sft(dataclasses.replace(cfg, pack=False), ByteTokenizer())
    SFTLoader(unpacked.train, seq_len=512, micro_batch_size=1, dp_rank=0, dp_world=2, seed=0)


def test_rows_too_long_for_seq_len_say_why_on_every_rank() -> None:
    """Three examples fit data.seq_len 9 + 1 after a cut, two keep no answer token: the
    paragraph counts both, names the longest example and the key to raise, and every
    rank builds the same one (the launcher reports whichever rank failed first)."""
    examples = _examples([6, 30, 12]) + [
        Example(ids=torch.arange(n).numpy(), train=(torch.arange(n) >= 15).numpy())
        for n in (20, 41)
    ]  # fmt: skip
    rows, stats = pack(examples, seq_len=9, pad_id=0, packed=False)
    assert (len(rows), stats.truncated, stats.dropped) == (3, 4, 2)
    messages = set()
    for rank in (0, 1):
        with pytest.raises(DataError) as err:
            SFTLoader(
                rows, seq_len=9, micro_batch_size=1, dp_rank=rank, dp_world=2, seed=0, grad_accum=2
            )
        messages.add(str(err.value))
    (text,) = messages
    assert "packs into 3 rows of data.seq_len 9, fewer than one step needs" in text
    assert "of 5 example(s), 4 are longer than data.seq_len + 1 = 10 tokens" in text
    assert "2 were then dropped" in text
    assert "The longest example has 41 tokens: raise data.seq_len (to 40" in text


def _models() -> dict[str, torch.nn.Module]:
    from tiny_hf import tiny_config

    from fsdpkit import init_weights
    from fsdpkit.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    built_in = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    init_weights(built_in, seed=0)
    out: dict[str, torch.nn.Module] = {"fsdpkit-llama": built_in}
    for arch in ("llama", "gpt2"):
        out[f"hf-{arch}"] = transformers.AutoModelForCausalLM.from_config(
            tiny_config(arch, vocab_size=64, dim=32), dtype=torch.float32
        )
    return out


@pytest.mark.parametrize("name", ["fsdpkit-llama", "hf-llama", "hf-gpt2"])
def test_packed_and_unpacked_give_the_same_per_example_losses(name: str) -> None:
    model = _models()[name].eval()
    examples = _examples([9, 5, 12, 7, 4, 10])
    packed, _ = pack(examples, seq_len=24, pad_id=0, packed=True)
    single, _ = pack(examples, seq_len=24, pad_id=0, packed=False)
    assert len(packed) < len(single)
    with torch.no_grad():
        p = token_losses(model, packed.take(torch.arange(len(packed))))
        s = token_losses(model, single.take(torch.arange(len(single))))
    per_example_packed = []
    positions = packed.take(torch.arange(len(packed))).positions
    for r in range(len(packed)):  # split each packed row at its position resets
        pos = positions[r].tolist()
        starts = [i for i, q in enumerate(pos) if q == 0] + [len(pos)]
        per_example_packed += [float(p[r, a:b].sum()) for a, b in itertools.pairwise(starts)]
    per_example_single = [float(s[r].sum()) for r in range(len(single))]
    nonzero = [x for x in per_example_packed if x != 0.0]  # padding segments hold no loss
    torch.testing.assert_close(nonzero, per_example_single, rtol=1e-5, atol=0)
    assert sft_loss(model, single.take(torch.arange(2))).ndim == 0
