"""The micro-batch of supervised fine-tuning data: inputs, targets, positions.

[Note: SFT batches]
Plain-text training hands the loss a (batch, seq + 1) tensor of token ids and predicts
every token. SFT needs more than ids, so its loader hands out an ``SFTBatch``:

- ``inputs`` (batch, seq): the token ids the model reads;
- ``targets`` (batch, seq): the id to predict at each position (the next token) where
  the loss counts (completion / assistant tokens), ``IGNORE_INDEX`` (-100) everywhere
  else (prompt, system and user turns, padding, and the first token of each packed
  example, which must not be predicted from the example before it). Any loss that
  honours ``ignore_index`` (``F.cross_entropy``, a chunked linear cross-entropy) works
  unchanged;
- ``positions`` (batch, seq) or None: position ids restarting at 0 at every packed
  example. Given to the model as ``position_ids``; transformers (5.x) and fsdpkit's
  Llama turn resets into block-diagonal causal attention, so no token attends across
  an example boundary. None when ``data.pack = false`` (one example per row).

It has ``.to(device)`` and ``.device`` like a tensor, so the training step and the
loop move and use it as they do token ids. The default loss for SFT data is
``fsdpkit.loss.answers.sft_loss``; a factory's own ``loss_fn(module, batch)``
receives the ``SFTBatch`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
"""Label value that losses skip (as PyTorch's and Hugging Face's ``ignore_index``)."""


@dataclass(frozen=True)
class SFTBatch:
    """One micro-batch of SFT data ([Note: SFT batches])."""

    inputs: torch.Tensor
    """(batch, seq) int64 token ids."""
    targets: torch.Tensor
    """(batch, seq) int64 next-token ids, IGNORE_INDEX where no loss is taken."""
    positions: torch.Tensor | None = None
    """(batch, seq) int64 position ids restarting at each packed example; None unpacked."""
    normalizer: float | None = None
    """What the sum of this micro-batch's token losses is divided by: the answer tokens
    of the whole optimizer step (all ranks, all micro-batches) over ranks x micro-batches,
    so the averaged gradient is the mean over every answer token of the step, however
    it is split ([Note: SFT loss weighting]). None: this batch's own count."""

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    @property
    def shape(self) -> torch.Size:
        """The inputs' shape (batch, seq)."""
        return self.inputs.shape

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> SFTBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SFTBatch(
            inputs=self.inputs.to(device, non_blocking=non_blocking),
            targets=self.targets.to(device, non_blocking=non_blocking),
            positions=move(self.positions),
            normalizer=self.normalizer,
        )

    def target_count(self) -> int:
        """Tokens whose prediction counts in the loss."""
        return int((self.targets != IGNORE_INDEX).sum())
