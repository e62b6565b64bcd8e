"""Fixed-length sequences, split across data-parallel ranks, in a seeded order.

Plain text: the token stream is cut into sequences of ``seq_len + 1`` tokens at a stride
of ``seq_len`` (neighbours share one token), so a row gives ``input = row[:-1]`` and
``target = row[1:]`` and every token is a target once (``Windows``). SFT rows are
packed examples (fsdpkit.data.packing). Either way the loader only sees a table of
sequences with ``take(ids)``, read from memory-mapped shards on demand.

[Note: equal batches on every rank]
One optimizer step takes ``G = W * B * A`` sequences (``W`` = data-parallel world
size, ``B`` = micro-batch size, ``A`` = micro-batches per step; see
fsdpkit.config.batch_split): micro-batch ``k`` of rank ``r`` is the ``(k * W + r)``-th chunk
of ``B``. An epoch has ``floor(num_sequences / G)`` steps on every rank; the
remainder is dropped (the same sequences on all ranks), so no rank runs out first
and leaves the others hanging in a collective. Epochs end only between optimizer
steps, so a step never mixes two epochs and, for a fixed ``G``, the order of
sequences does not depend on how ``G`` is split over ranks. The loader is infinite:
each epoch is a fresh permutation drawn from ``(seed, epoch)``, the same on every rank,
computed per position ([Note: order without an index] in fsdpkit.data.order).

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

from typing import Any, Protocol

import numpy as np
import torch

from fsdpkit.data.errors import DataError
from fsdpkit.data.order import Permutation
from fsdpkit.data.stream import TokenStream


class Sequences(Protocol):
    """A table of training sequences the loader draws from."""

    def __len__(self) -> int: ...

    def take(self, ids: np.ndarray, *, normalizer: float | None = None) -> Any: ...

    def targets_in(self, ids: np.ndarray) -> int: ...

    def too_small(self, *, world: int, batch: int) -> DataError: ...


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


def as_stream(tokens: torch.Tensor | TokenStream) -> TokenStream:
    if isinstance(tokens, TokenStream):
        return tokens
    return TokenStream([tokens.reshape(-1).numpy()])


class Windows:
    """Plain text: sequence ``i`` is tokens ``[i * seq_len, i * seq_len + seq_len + 1)``."""

    def __init__(self, stream: torch.Tensor | TokenStream, *, seq_len: int) -> None:
        self.stream = as_stream(stream)
        self.seq_len = seq_len
        self._n = num_sequences(len(self.stream), seq_len)

    def __len__(self) -> int:
        return self._n

    def take(self, ids: np.ndarray, *, normalizer: float | None = None) -> torch.Tensor:
        starts = np.asarray(ids, dtype=np.int64) * self.seq_len
        return torch.from_numpy(self.stream.gather(starts, self.seq_len + 1))

    def targets_in(self, ids: np.ndarray) -> int:
        return len(ids) * self.seq_len

    def too_small(self, *, world: int, batch: int) -> DataError:
        needed = world * batch * self.seq_len + 1
        return DataError(
            f"The training data is too small for one step: it has {len(self.stream)} tokens "
            f"(after holding out data.val_fraction), but one step across {world} "
            f"data-parallel rank(s) x {batch} sequences per rank x (data.seq_len "
            f"{self.seq_len} + 1, sharing one token) needs at least {needed} tokens. Use "
            "more data (data.path, data.max_bytes), or a smaller data.seq_len, "
            "train.global_batch_size, train.micro_batch_size x train.grad_accum or world size."
        )


def _check_args(*, seq_len: int, micro_batch_size: int, dp_rank: int, dp_world: int) -> None:
    if seq_len < 1 or micro_batch_size < 1:
        raise ValueError(
            f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be >= 1"
        )
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world={dp_world})")


class Loader:
    """Infinite per-rank iterator of micro-batches over ``seqs`` ([Note: equal batches on
    every rank], [Note: Data position maps sensibly]); ``weighted``: each micro-batch
    carries the step's normalizer ([Note: SFT loss weighting])."""

    def __init__(
        self,
        seqs: Sequences,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
        grad_accum: int = 1,
        weighted: bool = False,
    ) -> None:
        if grad_accum < 1 or micro_batch_size < 1:
            raise ValueError(f"grad_accum ({grad_accum}) and micro_batch_size must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world={dp_world})")
        self._seqs = seqs
        self._batch, self._rank, self._world = micro_batch_size, dp_rank, dp_world
        self._seed, self._shuffle, self._weighted = seed, shuffle, weighted
        self._num_seqs = len(seqs)
        self._micro_global = dp_world * micro_batch_size
        self._accum = grad_accum
        self._step_seqs = self._micro_global * grad_accum
        if self._num_seqs < self._step_seqs:
            raise seqs.too_small(world=dp_world, batch=micro_batch_size * grad_accum)
        self._epoch = 0
        self._consumed = 0
        self._micro = 0
        """Micro-batches of the current step already handed out."""
        self._order = Permutation(self._num_seqs, seed=seed, epoch=0, shuffle=shuffle)
        self._order_epoch = 0
        self._normalizer: float | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch, identical on every rank."""
        return self._num_seqs // self._step_seqs

    @property
    def num_sequences(self) -> int:
        """Training sequences in one epoch before the remainder is dropped."""
        return self._num_seqs

    @property
    def step_sequences(self) -> int:
        """Sequences of one optimizer step over all ranks (``G``)."""
        return self._step_seqs

    def _permutation(self, epoch: int) -> Permutation:
        """Epoch ``epoch``'s order: the same on every rank (seeded by (seed, epoch))."""
        if epoch != self._order_epoch:
            self._order = Permutation(
                self._num_seqs, seed=self._seed, epoch=epoch, shuffle=self._shuffle
            )
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> Any:
        """This rank's next micro-batch; a step's first one rolls into the next epoch
        when the current one has fewer than a step's sequences left."""
        if self._micro == 0 and self._num_seqs - self._consumed < self._step_seqs:
            self._epoch += 1
            self._consumed = 0
        order = self._permutation(self._epoch)
        if self._micro == 0 and self._weighted:
            step = order(np.arange(self._consumed, self._consumed + self._step_seqs))
            self._normalizer = self._seqs.targets_in(step) / (self._world * self._accum)
        start = self._consumed + self._rank * self._batch
        ids = order(np.arange(start, start + self._batch))
        batch = self._seqs.take(ids, normalizer=self._normalizer)
        self._consumed += self._micro_global
        self._micro = (self._micro + 1) % self._accum
        return batch

    def next_step(self) -> list[Any]:
        """This rank's micro-batches of the next optimizer step."""
        return [self.next_batch() for _ in range(self._accum)]

    def state_dict(self) -> dict[str, int]:
        """The position as (epoch, global sequences consumed): independent of world size."""
        return {"epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (saved at any world size); see the module's notes."""
        self._epoch, self._consumed = parse_position(state)
        self._micro = 0


def parse_position(state: dict[str, int]) -> tuple[int, int]:
    """(epoch, consumed) of a saved data position ([Note: Data position maps
    sensibly]); a DataError when it is not one."""
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
    return epoch, consumed


class PackedLoader(Loader):
    """Infinite per-rank iterator of ``(micro_batch_size, seq_len + 1)`` int64 tensors
    over a token stream (a tensor, or memory-mapped shards)."""

    def __init__(
        self, tokens: torch.Tensor | TokenStream, *, seq_len: int, micro_batch_size: int, **kw: Any
    ) -> None:
        _check_args(
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            dp_rank=kw["dp_rank"],
            dp_world=kw["dp_world"],
        )
        super().__init__(Windows(tokens, seq_len=seq_len), micro_batch_size=micro_batch_size, **kw)


def validation_batches(
    tokens: torch.Tensor | TokenStream,
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
    windows = Windows(tokens, seq_len=seq_len)
    return validation_from(
        windows,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        max_batches=max_batches,
    )


def validation_from(
    seqs: Sequences,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    max_batches: int,
    weighted: bool = False,
) -> list[Any]:
    """``validation_batches`` over any table (SFT: each batch weighted by its step)."""
    out = []
    step = dp_world * micro_batch_size
    for seq_ids in validation_ids(
        len(seqs),
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        max_batches=max_batches,
    ):
        ids = seq_ids.numpy()
        normalizer = None
        if weighted:
            first = int(ids[0]) - dp_rank * micro_batch_size
            normalizer = seqs.targets_in(np.arange(first, first + step)) / dp_world
        out.append(seqs.take(ids, normalizer=normalizer))
    return out


def validation_ids(
    num_seqs: int, *, micro_batch_size: int, dp_rank: int, dp_world: int, max_batches: int
) -> list[torch.Tensor]:
    """Sequence ids of this rank's validation micro-batches (see ``validation_batches``)."""
    per_step = dp_world * micro_batch_size
    count = min(max(max_batches, 0), num_seqs // per_step)
    firsts = [i * per_step + dp_rank * micro_batch_size for i in range(count)]
    return [torch.arange(first, first + micro_batch_size) for first in firsts]
