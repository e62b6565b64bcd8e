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
is the default tokenizer. Reading and checking the directory without building or
loading anything is fsdpkit.models.hf.directory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fsdpkit.checkpoint.hf_weights import LoadReport, load_hf_weights
from fsdpkit.models.buffers import meta_params
from fsdpkit.models.errors import ModelError
from fsdpkit.models.hf.directory import HFSource, transformers_module
from fsdpkit.models.hf.initialize import init_like_hf


def construct(config: Any) -> nn.Module:
    """The causal-LM of ``config`` with parameters on meta and the constructor's
    buffers, fp32, without a KV cache (training never reuses one)."""
    transformers = transformers_module()
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
