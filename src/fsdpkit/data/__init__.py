"""The data pipeline: corpus -> tokens -> train/val split -> per-rank packed batches.

Typical use in a training loop::

    tokenizer = build_tokenizer(cfg.data)
    train, val = split_tokens(load_token_stream(cfg.data, tokenizer),
                              val_fraction=cfg.data.val_fraction)
    loader = PackedLoader(train, seq_len=cfg.data.seq_len, micro_batch_size=B,
                          dp_rank=rank, dp_world=world, seed=cfg.train.seed)
    batch = loader.next_batch()          # (B, seq_len + 1); input [:, :-1], target [:, 1:]

``loader.state_dict()`` is world-size independent; see ``fsdpkit.data.loader``.
SFT data (``.jsonl`` prompt/completion or chat rows): ``fsdpkit.data.sft`` reads and
checks the rows, ``chat`` applies chat templates, ``packing`` lays examples into rows,
``sft_loader.SFTLoader`` hands out ``SFTBatch`` micro-batches (docs/finetune.md).
"""

from fsdpkit.data.batch import SFTBatch
from fsdpkit.data.corpus import load_token_stream, read_documents
from fsdpkit.data.errors import DataError
from fsdpkit.data.loader import PackedLoader, split_tokens, validation_batches
from fsdpkit.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "PackedLoader",
    "SFTBatch",
    "Tokenizer",
    "build_tokenizer",
    "load_token_stream",
    "read_documents",
    "split_tokens",
    "validation_batches",
]
