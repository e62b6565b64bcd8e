"""Ring attention for ``parallel.cp_attention = "ring"``: torch's context-parallel SDPA
(``torch.distributed.tensor.experimental``), the other way to split attention over the
cp axis ([Note: Ulysses context parallelism] in fsdpkit.sharding.context.attention is the default).

[Note: ring attention]
Each cp rank keeps its query tokens and all its heads; the keys and values travel
instead. torch's ring SDPA (``_templated_ring_attention``) computes attention of the
local queries against each rank's key / value block in turn and merges the partial
results by their log-sum-exp; its backward sends the key / value gradients around the
ring the same way. Entry point: SDPA called on DTensors sharded by sequence
(``Shard(2)`` on the cp mesh), which DTensor dispatches to the ring handlers.

- Causal only, no attention mask: packed rows (several examples per row, a document
  mask) cannot use it; ``slice_batch`` refuses them with ring attention.
- Load balance: with a causal mask a rank holding early tokens would have little to
  do, so the sequence is cut into 2 x cp chunks and rank r holds chunks r and
  2 cp - 1 - r (torch's head-tail order, ``head_tail_index``; its ring assumes this
  order whenever ``_cp_options.enable_load_balance`` is set, which ``enable_ring``
  does). Position ids travel with the tokens, so RoPE stays right.
- Heads need not divide by cp (Ulysses needs that); grouped key / value heads are
  repeated to the query heads before the ring (its kernels take equal head counts).
- Kernels: on CUDA torch's own handlers for the flash / memory-efficient / cuDNN SDPA
  kernels (``_enable_context_parallel_dispatcher``). On CPU torch registers none, so
  ``enable_ring`` registers handlers for the CPU flash-attention kernel that call the
  same ring functions (``_cpu_forward`` / ``_cpu_backward``): torch's algorithm, torch's
  CPU kernel, fsdpkit's adapter between them (what fsdpkit's gloo tests run).
  Both use torch's private ring functions; ``enable_ring`` refuses by field when this
  torch lacks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdpkit.errors import ConfigError

_SEQ = 2
"""The sequence dimension of SDPA's (batch, heads, seq, head_dim) inputs."""


def head_tail_index(*, seq: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The sequence positions cp rank ``rank`` holds under ring attention: chunks ``rank``
    and ``2 cp - 1 - rank`` of 2 x cp equal chunks ([Note: ring attention])."""
    if seq % (2 * cp):
        raise ConfigError(
            f'parallel.cp_attention = "ring" splits every sequence into 2 x parallel.cp = '
            f"{2 * cp} equal chunks (two per rank, for load balance); the batch's sequence "
            f"is {seq} tokens. Set data.seq_len to a multiple of {2 * cp}."
        )
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, first.new_tensor(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))])


@dataclass(frozen=True)
class RingAttention:
    """Attention of this rank's tokens over the whole sequence by torch's ring SDPA
    over ``mesh`` (the cp sub-mesh); same call as ``UlyssesAttention``."""

    mesh: DeviceMesh

    def whole_mask(self, positions: torch.Tensor) -> None:
        """No mask: ring attention is causal over the whole sequence (packed rows were
        refused before the forward, ``slice_batch``)."""
        return None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """q (b, h, s, d), k / v (b, h_kv, s, d) of this rank's s tokens (head-tail
        order) -> (b, h, s, d). ``mask`` is ignored: a caller's mask is built from the
        local positions, whose head-tail gap would read as a document boundary."""
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (
            DTensor.from_local(t, self.mesh, [Shard(_SEQ)], run_check=False) for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout
        )
        return out.to_local()  # type: ignore[no-any-return,attr-defined]


def enable_ring(*, device_type: str) -> None:
    """Route SDPA on sequence-sharded DTensors to torch's ring attention, load-balanced
    ([Note: ring attention]). Process-wide; call once before the first forward."""
    try:
        from torch.distributed.tensor.experimental import _context_parallel as cp_api
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as e:  # pragma: no cover - torch without context parallelism
        raise ConfigError(
            f'parallel.cp_attention = "ring" needs torch\'s context-parallel attention '
            f"(torch.distributed.tensor.experimental), which this torch {torch.__version__} "
            f'lacks ({e}). Use parallel.cp_attention = "ulysses".'
        ) from e
    cp_api._cp_options.enable_load_balance = True
    if device_type == "cuda":
        cp_api._enable_context_parallel_dispatcher()
        return
    if device_type != "cpu":
        raise ConfigError(
            f'parallel.cp_attention = "ring" runs on CUDA (torch\'s kernels) and CPU '
            f"(fsdpkit's adapter to torch's CPU kernel); this run's devices are "
            f'{device_type!r}. Use parallel.cp_attention = "ulysses".'
        )
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers
    handlers[_attention.aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_forward
    handlers[_attention.aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = (
        _cpu_backward
    )


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _sharded(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(t, mesh, [Shard(_SEQ)], run_check=False)


def _cpu_forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor handler of ``_scaled_dot_product_flash_attention_for_cpu``: (q, k, v,
    dropout_p, is_causal; attn_mask, scale) -> (output, logsumexp), each Shard(2)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    q, k, v = args[:3]
    if kwargs.get("attn_mask") is not None:
        raise ConfigError(
            'parallel.cp_attention = "ring" runs causal attention without a mask; this '
            'model passed one. Use parallel.cp_attention = "ulysses".'
        )
    mesh = q.device_mesh
    out = _attention._templated_ring_attention(
        mesh.get_group(),
        _SEQ,
        op,
        _local(q),
        _local(k),
        _local(v),
        is_causal=args[4] if len(args) > 4 else kwargs.get("is_causal", False),
        dropout_p=args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0),
        scale=kwargs.get("scale"),
    )
    return tuple(_sharded(t, mesh) for t in out)


def _cpu_backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor handler of ``_scaled_dot_product_flash_attention_for_cpu_backward``:
    (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal; scale) -> q, k, v grads."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    grad_out, q, k, v, out, lse, dropout_p, is_causal = args[:8]
    mesh = q.device_mesh
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(),
        _SEQ,
        op,
        grad_out=_local(grad_out),
        grad_out_name="grad_out",
        query=_local(q),
        key=_local(k),
        value=_local(v),
        out=_local(out),
        logsumexp=_local(lse),
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )
    return tuple(_sharded(t, mesh) for t in grads)
