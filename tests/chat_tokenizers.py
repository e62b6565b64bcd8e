"""Two tiny tokenizer directories in the shape of real ones, written offline.

A byte-level BPE (as Llama 3's and Qwen2.5's are) trained in milliseconds on a few
sentences, wrapped in transformers' ``PreTrainedTokenizerFast`` and saved with
``save_pretrained`` (tokenizer.json, tokenizer_config.json, chat_template.jinja):

- ``llama3``: adds ``<|begin_of_text|>`` on encode (a TemplateProcessing post-processor,
  as Llama 3's tokenizer.json has), EOS ``<|eot_id|>`` (Llama 3 Instruct's), pad
  ``<|end_of_text|>``, and TRL's copy of Llama 3's chat template, which writes the BOS
  itself;
- ``chatml``: no BOS (Qwen2.5's), EOS ``<|im_end|>``, pad ``<|endoftext|>``, and TRL's
  copy of Qwen2.5's template.

The templates are TRL's own files, so TRL recognises them and swaps in its training
variants (``{% generation %}`` markers) for ``assistant_only_loss``, as it does for the
real models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = [
    "Hello world, this is a tiny corpus.",
    "Is 4 even? Yes. And 7? No, 7 is odd.",
    "Question: what is 2+2?\nAnswer: 4",
    "The quick brown fox jumps over the lazy dog.",
    "system user assistant You are a helpful assistant. Be brief.",
] * 20
SPECIALS = {
    "llama3": (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    "chatml": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
}
KINDS = tuple(SPECIALS)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Is 4 even?"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And 7?"},
    {"role": "assistant", "content": "No, 7 is odd."},
]
"""A short multi-turn conversation (two replies), the SFT tests' sample."""


def trl_template(name: str) -> str:
    """One of TRL's chat template files (``llama3.jinja``, ``qwen2_5.jinja``...)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text(encoding="utf-8")


def write_chat_tokenizer(out: Path, kind: str) -> Path:
    """Write the ``kind`` tokenizer (``llama3`` or ``chatml``) into ``out``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS[kind]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    named: dict[str, Any]
    if kind == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
        named = {"bos_token": bos, "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
        template = trl_template("llama3.jinja")
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = trl_template("qwen2_5.jinja")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=template, **named
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out
