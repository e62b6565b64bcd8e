"""``model.hf = DIR``: a local Hugging Face model directory as a first-class model.

The directory holds ``config.json`` and, optionally, safetensors weights (one file or
shards with an index) and tokenizer files. Nothing is ever downloaded. The run:

1. builds ``AutoModelForCausalLM.from_config`` with parameters on meta and buffers
   computed by the model's own constructor (``meta_params``: RoPE tables, embedding
   scales; see [Note: buffers of meta models]), in fp32 (precision is FSDP's job);
2. shards it with ``fsdpkit.shard``, one FSDP unit per ``_no_split_modules`` block
   (generic detection when the model names none that it has);
3. reads each rank's own slices of the weights (``load_hf_weights``: DCP's
   HuggingFaceStorageReader), so no rank holds the full model;
4. initializes what the directory lacks (everything, for a bare config.json) with the
   model's own ``_init_weights`` ([Note: HF init on shards]).

The model's forward computes the logits; fsdpkit's next-token loss shifts the labels
once (no ``labels`` are passed to the HF forward). The directory's ``tokenizer.json``
is the default tokenizer.
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpkit.checkpoint.hf_weights import LoadReport, load_hf_weights, refuse_quantized
from fsdpkit.config import RunConfig
from fsdpkit.data import run_tokenizer
from fsdpkit.models.buffers import meta_params
from fsdpkit.models.errors import ModelError
from fsdpkit.models.hf_init import init_like_hf

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


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model.hf needs the `transformers` package, which is not installed. "
            "Run `pip install 'fsdpkit[hf]'`."
        ) from None
    return transformers


def _read_config(path: Path) -> Any:
    transformers = _transformers()
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


def construct(config: Any) -> nn.Module:
    """The causal-LM of ``config`` with parameters on meta and the constructor's
    buffers, fp32, without a KV cache (training never reuses one)."""
    transformers = _transformers()
    config = copy.deepcopy(config)
    config.use_cache = False
    try:
        with meta_params():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:
        raise ModelError(
            f"model.hf: transformers has no causal-LM class for this config.json "
            f"(model_type {getattr(config, 'model_type', '?')!r}): {exc}. fsdpkit trains "
            "decoder language models (AutoModelForCausalLM)."
        ) from None
    return model


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


class HFWeights:
    """The initializer ``shard`` runs for a ``model.hf`` model: read the directory's
    weights (each rank its own slices, keys mapped by transformers' own conversions),
    then the model's own init for what is not read: everything for a bare config.json,
    the missing weights only with ``init_missing`` (else they are an error)."""

    def __init__(self, source: HFSource, *, seed: int, init_missing: bool = False) -> None:
        self.source = source
        self.seed = seed
        self.init_missing = init_missing
        self.report: LoadReport | None = None
        """What loading found (None until it ran, or for a bare config.json)."""

    def __call__(self, model: nn.Module) -> None:
        names = [n for n, _ in model.named_parameters()]
        shadow = construct(self.source.config)
        if self.source.has_weights:
            self.report = load_hf_weights(
                model, self.source.path, allow_missing=self.init_missing, shadow=shadow
            )
            names = self.report.missing
        if names:
            init_like_hf(model, shadow=shadow, names=names, seed=self.seed)

    def describe(self) -> str:
        """For the run's first lines: where the weights came from."""
        path = self.source.path
        if not self.source.has_weights:
            return (
                f"model.hf = {path}: config.json only, every weight is freshly initialized "
                "with the model's own init (seeded by train.seed)"
            )
        report = self.report
        if report is None:
            return f"model.hf = {path}: weights read from the directory"
        how = " (transformers' conversions of this family applied)" if report.converted else ""
        if not report.missing:
            return f"model.hf = {path}: every weight read from the directory{how}"
        return (
            f"model.hf = {path}: {len(report.missing)} weight(s) NOT in the directory are "
            f"freshly initialized (model.init_missing = true; e.g. {report.missing[:3]}); "
            f"the rest read from it{how}"
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
