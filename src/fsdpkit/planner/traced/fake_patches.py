"""What the traced planner changes in torch and the model code while it traces
([Note: traced planning] in fsdpkit.planner.traced.trace): each patch is a context manager
that restores the original on exit, and each exists because a real run computes a
value from a real tensor where a fake tensor has none.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _disable_current_modes

from fsdpkit.models import llama
from fsdpkit.planner.experts.routing import received_rows
from fsdpkit.sharding.context import attention as context
from fsdpkit.sharding.context import batch as context_batch
from fsdpkit.sharding.experts.dispatch import ExpertDispatch


@contextlib.contextmanager
def wrapped(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``wrap(original)`` inside; restored on exit."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def real_meshes() -> Iterator[None]:
    """Mesh rank tensors stay real tensors: an int ``reshard_after_forward`` makes
    ``fully_shard`` build a sub-mesh from the mesh's rank tensor, and a DTensor
    parameter (tensor parallelism) makes it join the data and tp axes into one mesh
    (``DeviceMesh._concatenate``), whose ranks are laid out and indexed from the root
    mesh's real rank map. Both must run with fake mode paused, or the fake mode meets
    a real int tensor (``aten.as_strided``) and refuses it."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(wrapped(_fully_shard_module, "_get_post_forward_mesh_info", paused))
        stack.enter_context(wrapped(DeviceMesh, "__init__", paused))
        stack.enter_context(wrapped(DeviceMesh, "mesh", lambda p: property(paused(p.fget))))
        yield


def paused(original: Any) -> Any:
    """``original`` run with fake mode paused (it reads real rank tensors)."""

    def real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    return real


def _unpacked_hf_batches() -> contextlib.AbstractContextManager[None]:
    """[Note: HF masks under fake tensors]
    transformers decides whether a batch is packed (``position_ids`` restarting) by
    evaluating a tensor (``masking_utils.find_packed_sequence_indices``); on fake
    tensors it cannot, assumes packed and builds an explicit attention mask. That
    sends SDPA down the masked path: per layer a float mask and K/V repeated to every
    head are saved for backward (+0.75 MiB on each HF row of bench/plan_accuracy.py
    without checkpointing), where the real run, given the same plain token batches,
    finds them unpacked and calls the causal GQA kernel without a mask. The traced
    step only feeds plain batches (no ``position_ids``), so on fake tensors the answer
    is "not packed", as in the real run."""
    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()  # another transformers version: nothing to correct

    def wrap(original: Any) -> Any:
        def unpacked_when_fake(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
                return None
            return original(*args, **kwargs)

        return unpacked_when_fake

    return wrapped(masking_utils, "find_packed_sequence_indices", wrap)


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """[Note: built-in masks under fake tensors]
    The built-in Llama given ``position_ids`` (always under context parallelism:
    fsdpkit.sharding.context.batch gives every cp rank its global positions) asks
    ``document_mask`` whether a row holds several examples, by evaluating the
    positions; fake tensors have no values to evaluate. The traced step feeds plain
    token batches, whose positions are ``arange(seq)`` (whole or sliced, one example
    per row), so the real run's answer is "no mask": give it on fake positions.
    Ring attention asks the same question of the positions to refuse packed rows
    (``context_batch._refuse_packed``, [Note: ring attention]); the answer, "not
    packed", is the same, so on fake positions it passes."""

    def wrap(original: Any) -> Any:
        def unmasked_when_fake(position_ids: torch.Tensor) -> torch.Tensor | None:
            return None if isinstance(position_ids, FakeTensor) else original(position_ids)

        return unmasked_when_fake

    with contextlib.ExitStack() as stack:
        for module in (llama, context):  # the model's forward and the cp root hook
            stack.enter_context(wrapped(module, "document_mask", wrap))
        stack.enter_context(wrapped(context_batch, "_refuse_packed", wrap))
        yield


def _untracked_dtensor_metadata() -> contextlib.AbstractContextManager[None]:
    """[Note: DTensor metadata under the tracker]
    Under tensor parallelism every op on a DTensor activation first derives its
    output's global shape by running the op on fake tensors of the *global* shapes
    (``ShardingPropagator._propagate_tensor_meta_non_cached``) and caches the answer.
    A real run does that in a fake mode of its own, allocating nothing; in the trace
    it ran inside the tracker, which counted those global-size tensors wherever an op
    was first seen (the backward of the last block with activation checkpointing:
    +2.4% on bench/plan_accuracy.py's "MP A dp2 x tp2 +AC", +4.4% on "tp4 MHA +AC").
    Run it with every mode suspended, as in the real run: it then makes its own."""

    def wrap(original: Any) -> Any:
        def untracked(*args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                return original(*args, **kwargs)

        return untracked

    return wrapped(ShardingPropagator, "_propagate_tensor_meta_non_cached", wrap)


@contextlib.contextmanager
def _grouped_mm_any_dtype() -> Iterator[None]:
    """[Note: grouped GEMMs under fake tensors]
    transformers' mixture-of-experts layers run every expert in one ``torch._grouped_mm``
    (``integrations/moe.py``), which torch runs in fp32 on CPU and in bf16 on GPUs; its
    meta kernel, written from the CUDA kernel's checks, refuses anything but bf16, so a
    traced fp32 step of a Mixtral or Qwen3-MoE stopped there. The output's size does
    not depend on the offsets' values (one row per routed token, or one matrix per
    expert for the weight gradient), so it is torch's own output rule
    (``_create_grouped_mm_output_tensor``) without the dtype check, only for non-bf16
    inputs; bf16 keeps torch's kernel."""
    from torch import _meta_registrations

    def applies(func: Any) -> bool:
        return func is torch.ops.aten._grouped_mm.default

    def output(mode: FakeTensorMode, func: Any, *args: Any, **kwargs: Any) -> Any:
        a, b = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if a.dtype == torch.bfloat16:
            return NotImplemented
        with fake_impls.in_kernel_invocation_manager(mode):
            out = _meta_registrations._create_grouped_mm_output_tensor(
                a, b, offs, kwargs.get("out_dtype")
            )
        return FakeTensor(mode, out, a.fake_device)

    entry = (applies, output)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


def _routed_dispatch(
    loads: tuple[tuple[float, ...], ...],
) -> contextlib.AbstractContextManager[None]:
    """[Note: expert parallelism in the plan]
    Expert parallelism's dispatch sizes its all-to-alls from the routing's per-expert
    counts (``ExpertDispatch.routes``, fsdpkit.sharding.experts.dispatch): a real run's rank
    receives the rows its experts were given, which fake tensors do not know. The traced
    step sends each rank's tokens x top_k rows in equal parts to the ep ranks and, by
    default, routes the balanced case: the rank receives as many, spread over its
    experts; the grouped GEMMs' buffers then hold tokens x top_k rows, as without ep.
    A real step's rank holds its experts' share of the global routing instead: up to
    ep x tokens x top_k rows when every rank's tokens choose its experts (the plan's
    note states that bound, fsdpkit.planner.experts.routed). Given a routing ([Note: routing in
    the plan] in fsdpkit.planner.experts.routing, e.g. a run's measured ``moe_imbalance``) the
    rank receives each layer's load x tokens x top_k rows instead (``loads``, per MoE
    layer in forward order the loads of its successive dispatches, repeating; empty:
    balanced). With a capacity factor a rank
    receives at most C = ceil(factor x tokens x top_k / E) rows per expert from each
    rank, E x C in all: the balanced default traces that bound (and sends all its
    tokens x top_k), a given routing is capped by it."""
    layers: dict[int, int] = {}  # dispatch -> its MoE layer, in first-call (forward) order
    calls: dict[int, int] = {}  # dispatch -> its calls so far

    def wrap(original: Any) -> Any:
        def routed(
            self: ExpertDispatch, counts: torch.Tensor, received: torch.Tensor, *, assignments: int
        ) -> Any:
            if not isinstance(counts, FakeTensor):
                return original(self, counts, received, assignments=assignments)
            cap = None
            if self.capacity_factor:
                cap = self.experts * math.ceil(self.capacity_factor * assignments / self.experts)
            layer = layers.setdefault(id(self), len(layers))
            call = calls[id(self)] = calls.get(id(self), -1) + 1
            if not loads:
                rows = assignments if cap is None else cap
            else:
                each = loads[min(layer, len(loads) - 1)]
                load = each[call % len(each)]
                rows = received_rows(assignments=assignments, load=load, capacity_rows=cap)
            index = torch.zeros(rows, 1, dtype=torch.long, device=counts.device)
            return _even(assignments, self.ep), _even(rows, self.ep), index

        return routed

    return wrapped(ExpertDispatch, "routes", wrap)


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


@contextlib.contextmanager
def faithful_step(*, loads: tuple[tuple[float, ...], ...] = ()) -> Iterator[None]:
    """The traced step allocates and masks as the real one: unpacked batches for
    transformers' masks and the built-in Llama's alike, DTensor's shape bookkeeping
    kept out of the count, experts' grouped GEMMs in any dtype and an expert dispatch
    at each MoE layer's ``loads`` (balanced when empty; the notes above)."""
    with (
        _unpacked_hf_batches(),
        _unpacked_positions(),
        _untracked_dtensor_metadata(),
        _grouped_mm_any_dtype(),
        _routed_dispatch(loads),
    ):
        yield
