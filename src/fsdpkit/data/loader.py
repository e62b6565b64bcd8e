"""Packed fixed-length sequences, split across data-parallel ranks.

The token stream is cut into sequences of ``seq_len + 1`` tokens at a stride of
``seq_len`` (neighbours share one token), so a row gives ``input = row[:-1]`` and
``target = row[1:]`` and every token is a target once. The validation split is the
END of the stream (``split_tokens``), so adding training data later leaves it alone.

[Note: equal batches on every rank]
One optimizer step takes ``G = W * B * A`` sequences (``W`` = data-parallel world
size, ``B`` = micro-batch size, ``A`` = micro-batches per step; see
fsdpkit.config.batch): micro-batch ``k`` of rank ``r`` is the ``(k * W + r)``-th chunk
of ``B``. An epoch has ``floor(num_sequences / G)`` steps on every rank; the
remainder is dropped (the same sequences on all ranks), so no rank runs out first
and leaves the others hanging in a collective. Epochs end only between optimizer
steps, so a step never mixes two epochs and, for a fixed ``G``, the order of
sequences does not depend on how ``G`` is split over ranks. The loader is infinite:
each epoch is a fresh permutation drawn from ``(seed, epoch)``, the same on every rank.

[Note: Data position maps sensibly]
The position is ``{"epoch": e, "consumed": c}``: ``c`` counts GLOBAL sequences of
epoch ``e``'s permutation already handed out, whatever the world size. Step ``g``
takes ``perm[g*G : (g+1)*G]``. A position saved at world size 2 and loaded at world
size 3 with the same ``G`` (``train.global_batch_size``) continues at the same point
of the same permutation: every later step holds exactly the sequences the
uninterrupted run's would, regrouped across ranks, none skipped or repeated. When
fewer than ``G`` sequences remain in an epoch, the epoch ends and the next one starts
at ``consumed = 0``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fsdpkit.data.errors import DataError


def split_tokens(tokens: torch.Tensor, *, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last ``val_fraction`` of the stream is held out (views, no copy)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(
            f"data.val_fraction must be in [0, 1), got {val_fraction}: it is the share of "
            "the token stream held out for validation (0 disables validation)."
        )
    n_val = int(tokens.numel() * val_fraction)
    n_train = tokens.numel() - n_val
    return tokens[:n_train], tokens[n_train:]


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """Sequences of ``seq_len + 1`` tokens at stride ``seq_len`` in ``num_tokens``."""
    return max(num_tokens - 1, 0) // seq_len


def _check_args(*, seq_len: int, micro_batch_size: int, dp_rank: int, dp_world: int) -> None:
    if seq_len < 1 or micro_batch_size < 1:
        raise ValueError(
            f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be >= 1"
        )
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world={dp_world})")


def _gather(tokens: torch.Tensor, seq_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` for each sequence id, int64."""
    starts = seq_ids.to(torch.int64) * seq_len
    index = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)
    return tokens[index].to(torch.int64)


class PackedLoader:
    """Infinite per-rank iterator of ``(micro_batch_size, seq_len + 1)`` int64 tensors.

    See [Note: equal batches on every rank] and [Note: Data position maps sensibly].
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
        grad_accum: int = 1,
    ) -> None:
        _check_args(
            seq_len=seq_len, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_world=dp_world
        )
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self._tokens = tokens.reshape(-1)
        self._seq_len = seq_len
        self._batch = micro_batch_size
        self._rank = dp_rank
        self._world = dp_world
        self._seed = seed
        self._shuffle = shuffle
        self._num_seqs = num_sequences(self._tokens.numel(), seq_len)
        self._micro_global = dp_world * micro_batch_size
        self._accum = grad_accum
        self._step_seqs = self._micro_global * grad_accum
        if self._num_seqs < self._step_seqs:
            raise _too_small(
                self._tokens.numel(),
                seq_len=seq_len,
                batch=micro_batch_size * grad_accum,
                world=dp_world,
            )
        self._epoch = 0
        self._consumed = 0
        self._micro = 0
        """Micro-batches of the current step already handed out."""
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch, identical on every rank."""
        return self._num_seqs // self._step_seqs

    @property
    def num_sequences(self) -> int:
        """Training sequences in one epoch before the remainder is dropped."""
        return self._num_seqs

    def next_batch(self) -> Any:
        """This rank's next micro-batch; a step's first one rolls into the next epoch
        when the current one has fewer than a step's sequences left."""
        if self._micro == 0 and self._num_seqs - self._consumed < self._step_seqs:
            self._epoch += 1
            self._consumed = 0
        perm = self._permutation(self._epoch)
        start = self._consumed + self._rank * self._batch
        batch = self._rows(perm[start : start + self._batch])
        self._consumed += self._micro_global
        self._micro = (self._micro + 1) % self._accum
        return batch

    def next_step(self) -> list[Any]:
        """This rank's micro-batches of the next optimizer step."""
        return [self.next_batch() for _ in range(self._accum)]

    def _rows(self, seq_ids: torch.Tensor) -> Any:
        """The sequences ``seq_ids`` as one micro-batch (SFTLoader returns an SFTBatch)."""
        return _gather(self._tokens, seq_ids, self._seq_len)

    def state_dict(self) -> dict[str, int]:
        """The position as (epoch, global sequences consumed): independent of world size."""
        return {"epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (saved at any world size); see the module's notes."""
        try:
            epoch, consumed = int(state["epoch"]), int(state["consumed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"the saved data position {state!r} is not {{'epoch': int, 'consumed': int}}; "
                "the checkpoint's data state is damaged or from another tool. Resume from "
                "another checkpoint or start the run afresh."
            ) from e
        if epoch < 0 or consumed < 0:
            raise DataError(
                f"the saved data position {state!r} has a negative epoch or count; resume "
                "from another checkpoint or start the run afresh."
            )
        self._epoch, self._consumed, self._micro = epoch, consumed, 0

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s sequence order: the same on every rank (seeded by (seed, epoch))."""
        if epoch != self._perm_epoch:
            if self._shuffle:
                rng = np.random.default_rng([self._seed % 2**63, epoch])
                self._perm = torch.from_numpy(rng.permutation(self._num_seqs))
            else:
                self._perm = torch.arange(self._num_seqs)
            self._perm_epoch = epoch
        return self._perm


def _too_small(num_tokens: int, *, seq_len: int, batch: int, world: int) -> DataError:
    needed = world * batch * seq_len + 1
    return DataError(
        f"The training data is too small for one step: it has {num_tokens} tokens (after "
        f"holding out data.val_fraction), but one step across {world} data-parallel "
        f"rank(s) x {batch} sequences per rank x (data.seq_len {seq_len} + 1, "
        f"sharing one token) needs at least {needed} tokens. Use more data (data.path, "
        "data.max_bytes), or a smaller data.seq_len, train.global_batch_size, "
        "train.micro_batch_size x train.grad_accum or world size."
    )


def validation_batches(
    tokens: torch.Tensor,
    *,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    max_batches: int,
) -> list[torch.Tensor]:
    """This rank's validation micro-batches: in order, no shuffle, same count on all ranks.

    Batch ``i`` of rank ``r`` is sequences ``[i*W*B + r*B, i*W*B + (r+1)*B)``. Returns
    ``[]`` on every rank when the split holds fewer than ``W * B`` sequences (or
    ``max_batches`` is 0): the caller then skips evaluation on all ranks alike.
    """
    _check_args(
        seq_len=seq_len, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_world=dp_world
    )
    flat = tokens.reshape(-1)
    ids = validation_ids(
        num_sequences(flat.numel(), seq_len),
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        max_batches=max_batches,
    )
    return [_gather(flat, seq_ids, seq_len) for seq_ids in ids]


def validation_ids(
    num_seqs: int, *, micro_batch_size: int, dp_rank: int, dp_world: int, max_batches: int
) -> list[torch.Tensor]:
    """Sequence ids of this rank's validation micro-batches (see ``validation_batches``)."""
    per_step = dp_world * micro_batch_size
    count = min(max(max_batches, 0), num_seqs // per_step)
    firsts = [i * per_step + dp_rank * micro_batch_size for i in range(count)]
    return [torch.arange(first, first + micro_batch_size) for first in firsts]
