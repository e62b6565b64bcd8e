"""The training loss computed from the hidden states and the output head in chunks.

``choose_loss(model, ...)`` decides, once per run, between the full-logits loss
(``next_token_loss`` / ``sft_loss``) and ``ChunkedLoss`` (``train.chunked_loss``);
``ChunkedLoss(model, batch)`` is a drop-in ``LossFn`` for both plain token ids and
SFT batches (same targets, same ignore index, same normalization).

[Note: the loss inside the root's forward]
The chunked loss needs the head's input and weight, never the head's output. During
the model's own forward call the head (a plain ``nn.Linear``) is made to return its
input, and a forward hook on the model, run before FSDP2's post-forward hook,
computes the chunked loss from that input and the head's weight and returns it as
the model's output. So:

- the head's weight is read while FSDP2 holds it unsharded: in the root unit (a tied
  head), or in the head's own unit, which is never resharded after forward ([Note:
  edge units] in fsdpkit.sharding.edges): one all-gather per micro-batch, as with
  full logits, whatever the strategy's ``reshard_after_forward``;
- the loss is the root's output, so FSDP2's pre-backward hook on it runs before the
  loss's backward and re-gathers the root if it was resharded; a head unit's
  post-backward (its reduce-scatter) runs when the loss's backward has produced the
  gradient of the head's input, as with full logits;
- any model whose head output is post-processed (logit soft-capping, scaling, a
  cast) is caught: the model's returned "logits" are then not the head's output
  tensor, and the call fails with an error naming ``train.chunked_loss`` instead of
  training on the wrong loss. ``auto`` avoids the known cases from the HF config.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.errors import ConfigError
from fsdpkit.loss.answers import model_kwargs, sft_loss
from fsdpkit.loss.chunked_ce import VocabShard, chunked_linear_cross_entropy
from fsdpkit.loss.contract import LossFn, ModelOutputError, logits_of, next_token_loss
from fsdpkit.models.accessors import output_embeddings
from fsdpkit.models.errors import ModelError
from fsdpkit.pretrained import is_hf_model

_LOGIT_POSTPROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "logits_soft_cap",
    "output_multiplier",
)
"""HF config keys of models that change the head's output before returning it."""

_VIEW_WARNING = r"FSDP2-wrapped module \(\w+\) returned a view tensor"
"""FSDP2's warning for a unit whose output is a view (fsdp/_fully_shard/_fsdp_state.py)."""


class HeadLossError(ModelError):
    """The model's output is not its head's output: the chunked loss cannot be used."""


def output_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection when it is a plain ``nn.Linear`` (HF's
    ``get_output_embeddings()``, else an ``lm_head`` attribute), otherwise None."""
    head = output_embeddings(model)
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        return head
    return None


def unsupported_reason(model: nn.Module, *, custom_loss: bool) -> str | None:
    """Why the chunked loss cannot replace this run's loss (None: it can)."""
    if custom_loss:
        return "the model factory returned its own loss_fn"
    if output_head(model) is None:
        return (
            "the model exposes no plain nn.Linear output head (get_output_embeddings() or "
            "lm_head; a LoRA-wrapped head is not plain)"
        )
    config = getattr(model, "config", None) if is_hf_model(model) else None
    for key in _LOGIT_POSTPROCESSING:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"the model post-processes its logits (config.{key})"
    return None


@dataclass(frozen=True)
class LossChoice:
    """The loss a run trains with, and why."""

    loss_fn: LossFn
    chunked: bool
    note: str | None = None
    """One line for the run's start (rank 0) when ``auto`` fell back."""


def choose_loss(
    model: nn.Module,
    *,
    mode: str,
    chunk_tokens: int,
    default: LossFn,
    custom_loss: bool,
    compiled: bool = False,
) -> LossChoice:
    """``train.chunked_loss`` resolved for ``model``: ``default`` is the full-logits
    loss the run would use (the factory's own when ``custom_loss``). ``auto`` is on
    wherever the head is a plain linear layer: then the chunked loss always lowers the
    peak (no N x V logits, fp32 copy or gradient; only one chunk's, and never more
    than full logits at any point: [Note: chunked cross-entropy peak]), so there is
    nothing to plan. ``compiled``: compile each chunk's kernels (``train.compile`` in
    low precision: [Note: compiling the chunk]). ConfigError for ``on`` where
    unsupported."""
    if mode == "off":
        return LossChoice(loss_fn=default, chunked=False)
    why = unsupported_reason(model, custom_loss=custom_loss)
    if why is None:
        chunked = ChunkedLoss(chunk_tokens=chunk_tokens, compiled=compiled)
        return LossChoice(loss_fn=chunked, chunked=True)
    if mode == "on":
        raise ConfigError(
            f"train.chunked_loss = on, but {why}. Set train.chunked_loss = auto (falls "
            "back to full logits) or off."
        )
    note = f"train.chunked_loss = auto: full logits, {why}"
    return LossChoice(loss_fn=default, chunked=False, note=note)


@dataclass(frozen=True)
class ChunkedLoss:
    """Mean fp32 cross-entropy over the predicted tokens, from the hidden states and
    the head in chunks of ``chunk_tokens`` ([Note: chunked cross-entropy]): the same
    value and gradients as ``next_token_loss`` (token ids) and ``sft_loss``
    (SFTBatch: ``IGNORE_INDEX`` targets skipped, divided by the batch's normalizer)."""

    chunk_tokens: int = 1024
    grad_into_weight: bool = False
    """The traced planner's setting (fsdpkit.loss.chunked_ce.chunked_linear_cross_entropy)."""
    compiled: bool = False
    """Each chunk's kernels compiled ([Note: compiling the chunk] in fsdpkit.loss.chunked_ce)."""

    def __call__(self, model: nn.Module, batch: SFTBatch | torch.Tensor) -> torch.Tensor:
        if isinstance(batch, SFTBatch):
            inputs, targets, normalizer = batch.inputs, batch.targets, batch.normalizer
            kwargs = model_kwargs(model, batch)
        else:
            inputs, targets, normalizer, kwargs = batch[:, :-1], batch[:, 1:], None, {}
        head = output_head(model)
        if head is None:
            raise HeadLossError(
                "train.chunked_loss: the model has no plain nn.Linear head; set "
                "train.chunked_loss = off."
            )

        def loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
            weight, bias, shard = vocab_shard(weight, bias)
            total = chunked_linear_cross_entropy(
                hidden, weight, bias, targets, chunk_tokens=self.chunk_tokens,
                ignore_index=IGNORE_INDEX, grad_into_weight=self.grad_into_weight,
                compiled=self.compiled, shard=shard,
            )  # fmt: skip
            if normalizer is not None:
                return total / normalizer
            return total / (targets != IGNORE_INDEX).sum()

        with loss_in_forward(model, head, inputs=inputs, loss=loss):
            return model(inputs, **kwargs)  # type: ignore[no-any-return]


@contextlib.contextmanager
def loss_in_forward(
    model: nn.Module,
    head: nn.Linear,
    *,
    inputs: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> Iterator[None]:
    """Inside: ``model(inputs)`` returns ``loss(hidden, head.weight, head.bias)``
    computed within its forward ([Note: the loss inside the root's forward])."""
    seen: dict[str, Any] = {}

    def head_forward(x: torch.Tensor) -> torch.Tensor:
        seen.update(weight=head.weight, bias=head.bias)
        return x

    def head_hook(_module: nn.Module, _args: Any, output: Any) -> None:
        seen["x"] = output  # after a tensor-parallel head's own hooks: a plain tensor

    def root_hook(_module: nn.Module, _args: Any, output: Any) -> torch.Tensor:
        x = seen.pop("x", None)
        if not isinstance(x, torch.Tensor) or _returned_logits(output, inputs) is not x:
            raise HeadLossError(
                f"train.chunked_loss: {type(model).__name__} does not return its output "
                "head's result unchanged (it post-processes the logits, e.g. soft-capping or "
                "scaling, or does not call the head), so the loss cannot be computed from "
                "the head in chunks. Set train.chunked_loss = off."
            )
        return loss(x, seen.pop("weight"), seen.pop("bias"))

    head.forward = head_forward  # type: ignore[method-assign,assignment]
    handle = model.register_forward_hook(root_hook, prepend=True)
    head_handle = head.register_forward_hook(head_hook)
    try:
        with warnings.catch_warnings():
            # A head unit returns its input, a view made by FSDP2's post-backward
            # registration; nothing modifies it in place (the loss reads it).
            warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
            yield
    finally:
        handle.remove()
        head_handle.remove()
        del head.forward


def vocab_shard(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, VocabShard | None]:
    """(weight, bias, None) for a whole head; for a head split by vocabulary over tp
    (a DTensor sharded on its rows, fsdpkit.sharding.tensor.plans) its local rows, bias and
    where they sit ([Note: vocabulary-parallel cross-entropy]). DTensor is imported
    here, where a loss runs: the planner reads this module's rules, and DTensor's
    import is most of a plan's start-up."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return weight, bias, None
    mesh = weight.device_mesh
    if weight.placements != (Shard(0),) or mesh.ndim != 1:
        raise HeadLossError(
            f"train.chunked_loss: the output head's weight is a DTensor placed "
            f"{weight.placements} on a {mesh.ndim}-D mesh; the chunked loss takes a whole "
            "head or one split by vocabulary rows over tp. Set train.chunked_loss = off."
        )
    local = weight.to_local()
    offset = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    return local, local_bias, VocabShard(group=mesh.get_group(), offset=offset)


def _returned_logits(output: Any, inputs: torch.Tensor) -> torch.Tensor | None:
    try:
        return logits_of(output, tokens=inputs)
    except ModelOutputError:
        return None


def default_loss(*, sft: bool, own: LossFn | None) -> LossFn:
    """The full-logits loss of a run: the factory's own loss when it gave one, else
    ``sft_loss`` for SFT data and ``next_token_loss`` for token ids."""
    if own is not None:
        return own
    return sft_loss if sft else next_token_loss
