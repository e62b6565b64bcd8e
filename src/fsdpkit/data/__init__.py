"""The data pipeline: sources -> prepared token shards -> per-rank batches.

Typical use in a training loop (fsdpkit.train does exactly this)::

    data = open_training_data(cfg.data, seed=cfg.train.seed, micro_batch=B, grad_accum=A,
                              dp_rank=rank, dp_world=world, eval_batches=4, work_dir=run_dir)
    print(data.note)                     # what the run trains on
    batches = data.loader.next_step()    # (B, seq_len + 1) token ids, or SFTBatch

``fsdpkit data prepare SRC... -o DIR`` (``prepare``) tokenizes sources once, in
parallel, into memory-mapped shards with a manifest; ``data.path = DIR`` trains on them
without reading the sources; raw sources go through the same prepare into the run's
cache. ``loader.state_dict()`` is world-size independent (fsdpkit.data.loader). SFT
schemas: fsdpkit.data.schemas; chat templates: fsdpkit.data.chat; packing:
fsdpkit.data.packing; mixtures: fsdpkit.data.mix. RL prompts (``train.objective =
grpo``): ``open_prompt_data`` (fsdpkit.data.prompts, fsdpkit.data.prompt_order). See
docs/data.md.
"""

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.data.corpus import load_token_stream, read_documents
from fsdpkit.data.errors import DataError
from fsdpkit.data.inspect import DatasetInfo, check_tokenizer, host_bytes, inspect_dataset
from fsdpkit.data.loader import Loader, PackedLoader, split_tokens, validation_batches
from fsdpkit.data.manifest import Manifest, is_dataset
from fsdpkit.data.mix import parse_mix
from fsdpkit.data.pipeline import TrainingData, open_training_data
from fsdpkit.data.prepare import Prepared, prepare
from fsdpkit.data.prompt_order import PromptBatch, PromptLoader, open_prompt_data
from fsdpkit.data.prompts import PromptRow, load_prompts
from fsdpkit.data.tokcheck import run_tokenizer
from fsdpkit.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "DataError",
    "DatasetInfo",
    "HFTokenizer",
    "Loader",
    "Manifest",
    "PackedLoader",
    "Prepared",
    "PromptBatch",
    "PromptLoader",
    "PromptRow",
    "SFTBatch",
    "Tokenizer",
    "TrainingData",
    "build_tokenizer",
    "check_tokenizer",
    "host_bytes",
    "inspect_dataset",
    "is_dataset",
    "load_prompts",
    "load_token_stream",
    "open_prompt_data",
    "open_training_data",
    "parse_mix",
    "prepare",
    "read_documents",
    "run_tokenizer",
    "split_tokens",
    "validation_batches",
]
