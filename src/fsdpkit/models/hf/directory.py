"""A local Hugging Face model directory, read and checked without building the model or
reading its weights: its config, whether it holds weights, its tokenizer, the files
an export ships. The launcher's checks, the doctor and the planner read a directory
through this module; building and loading it is fsdpkit.models.hf.construct.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fsdpkit.checkpoint.quantized import refuse_quantized
from fsdpkit.config import RunConfig
from fsdpkit.data import run_tokenizer
from fsdpkit.models.errors import ModelError

log = logging.getLogger(__name__)

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Everything but the weights that makes a directory loadable with ``from_pretrained``
(copied into exports)."""

HF_RUN_DIR = "hf"
"""Where a run directory keeps a copy of those files (``copy_hf_files``)."""

_TOKENIZER_ONLY = ("tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class HFSource:
    """A local Hugging Face model directory, checked."""

    path: Path
    config: Any
    """The ``transformers.PretrainedConfig`` read from ``config.json``."""
    has_weights: bool
    """Whether the directory holds safetensors weights (else: random init)."""
    tokenizer: Path | None
    """Its ``tokenizer.json``, if any."""


def transformers_module() -> Any:
    """``transformers``, or a ModelError saying which extra installs it."""
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model.hf needs the `transformers` package, which is not installed. "
            "Run `pip install 'fsdpkit[hf]'`."
        ) from None
    return transformers


def _read_config(path: Path) -> Any:
    transformers = transformers_module()
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelError(
            f"model.hf = {str(path)!r}: config.json could not be read by transformers "
            f"{transformers.__version__} ({type(exc).__name__}: {exc}). Models that need "
            "trust_remote_code are not supported (fsdpkit never runs code from a model "
            "directory); otherwise upgrade transformers or fix the file."
        ) from None


def _weights(path: Path) -> bool:
    if any(path.glob("*.safetensors")):
        return True
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ModelError(
            f"model.hf = {str(path)!r} holds pickled weights (*.bin / *.pt) but no "
            "*.safetensors. fsdpkit reads safetensors only (each rank reads its own slices; "
            'pickles can run code). Convert once with: python -c "from transformers import '
            f"AutoModelForCausalLM as M; M.from_pretrained('{path}').save_pretrained('OUT')\" "
            "and point model.hf at OUT."
        )
    return False


def _tokenizer(path: Path) -> Path | None:
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if any((path / name).is_file() for name in _TOKENIZER_ONLY):
        log.warning(
            "model.hf = %s has tokenizer files but no tokenizer.json; set data.tokenizer "
            "to a tokenizer.json (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) "
            "writes one for fast tokenizers), or the byte-level tokenizer is used.",
            path,
        )
    return None


def read_hf_dir(path: str | Path) -> HFSource:
    """Check a model directory and read its config (no weights are read here)."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        where = "does not exist" if not p.exists() else "has no config.json"
        raise ModelError(
            f"model.hf = {str(path)!r} {where}. Point model.hf at a local Hugging Face model "
            "directory (config.json, optional *.safetensors and tokenizer files), e.g. one "
            "written by save_pretrained or `python examples/make_tiny_hf_model.py DIR`. "
            "Nothing is downloaded."
        )
    refuse_quantized(p, field="model.hf")  # [Note: quantized checkpoints]
    return HFSource(
        path=p, config=_read_config(p), has_weights=_weights(p), tokenizer=_tokenizer(p)
    )


def with_model_tokenizer(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what an empty ``data.tokenizer`` means for ``model.hf``: the
    directory's tokenizer.json (unchanged when there is none: byte-level). The trainer,
    the doctor and the planner all resolve the tokenizer through this."""
    if not cfg.model.hf or cfg.data.tokenizer:
        return cfg
    found = _tokenizer(Path(cfg.model.hf).expanduser())
    return replace(cfg, data=replace(cfg.data, tokenizer=str(found))) if found else cfg


def tokenizer_vocab_size(cfg: RunConfig) -> int:
    """The vocabulary of the tokenizer ``fsdpkit train`` would use for ``cfg``: the
    model.hf directory's own when data.tokenizer is empty, else data.tokenizer's, else
    a prepared data.path's own, else byte-level (256; fsdpkit.data.run_tokenizer). The
    one rule for the run, the doctor and the planner."""
    return run_tokenizer(with_model_tokenizer(cfg).data).vocab_size


def check_inputs(source: HFSource, *, vocab_size: int, seq_len: int) -> None:
    """Token ids from the tokenizer must index inside the model's embedding, and the
    sequences fit its positions (GPT-2's learned positions would index past the table)."""
    config = source.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if positions is not None and seq_len > positions:
        raise ModelError(
            f"data.seq_len = {seq_len} is longer than model.hf = {str(source.path)!r} "
            f"supports ({positions} positions in config.json). Set data.seq_len to at most "
            f"{positions}."
        )
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and vocab_size > model_vocab:
        raise ModelError(
            f"the tokenizer has {vocab_size} tokens but model.hf = {str(source.path)!r} has "
            f"vocab_size {model_vocab}: token ids would index past the embedding. Use the "
            "model's own tokenizer (data.tokenizer empty picks the directory's tokenizer.json) "
            "or one with at most that many tokens."
        )


def copy_hf_files(src: Path, dest: Path) -> list[str]:
    """Copy config, generation config and tokenizer files (never weights) to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
            copied.append(name)
    return copied
