"""The memory tracker of a traced step and the gloo temporaries it counts.

torch's ``FSDPMemTracker`` counts every storage of one fake step; three things it
does not see, or sees wrong, against a real CPU run (all measured on torch 2.13):

- gloo's own buffers: it all-gathers into a temporary of the output's size and
  reduce-scatters a clone of its input (both seen in the allocator), so the trace runs
  FSDP2 with collectives that allocate exactly those temporaries around the (fake) call.
  Ring attention's k / v all-gather (torch's ``_AllGatherRotater``, [Note: ring
  attention memory] in fsdpkit.planner.replay.ringmem) flattens its input into a copy (freed
  at once), and its worker thread's temporary lives until the gather completes, as
  often as not after the first step's kernel: ``ring_gloo_buffers`` holds it until the
  first wait, which it cannot outlive ("MP A dp2 x cp2 ring +AC" of
  bench/plan_accuracy.py: 4 Q there, live at the real peak).
- a unit of several modules (``parallel.blocks_per_unit``): the tracker hooks each
  module on its own, whose forward hooks then reshard the unit after its first block
  (the trace read 6-8% low); ``UnitTracker`` hooks such a unit once, with FSDP2's own
  group-hook semantics.
- its post-backward wrapper tags the unit's gradients in a loop whose variable still
  holds the unit's last unsharded gradient while FSDP2's post-backward runs, so the
  trace kept that gradient alive through the reduce-scatter, where the real run has
  dropped it (``unsharded_param.grad = None``, then the copy into the reduce-scatter
  input). For most units the last parameter is a norm weight (bytes), but a unit of
  one parameter holds all of it: a tp-split embedding's gradient (a whole-size
  DTensor that FSDP2 redistributes to the parameter's placement) read +6.5% on the
  transformers tp2 x cp2 +AC rows. ``UnitTracker`` tags them without a lingering
  reference. (FSDP2's own ``foreach_reduce`` keeps what it copies in of the last
  gradient, the local rows, in a loop variable: [Note: the last gradient] in
  fsdpkit.planner.replay.gradlife; the trace sees that as the real run does.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._tools.fsdp2_mem_tracker import (
    FSDPMemTracker,
    _FSDPModState,
    _FSDPRefType,
    _FSDPState,
    _SavedFSDPMethods,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks


class GlooLikeAllGather(DefaultAllGather):
    """FSDP2's all-gather plus the temporary gloo gathers into (the output's size)."""

    def __call__(self, output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        staging = torch.empty_like(output_tensor)
        work = super().__call__(output_tensor, *args, **kwargs)
        del staging
        return work


class GlooLikeReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter plus the clone of the input gloo reduces."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        staging = torch.empty_like(input_tensor)
        work = super().__call__(output_tensor, input_tensor, *args, **kwargs)
        del staging
        return work


def model_gloo_buffers(model: torch.nn.Module) -> None:
    """Give every FSDP unit collectives that allocate gloo's temporaries."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(GlooLikeAllGather())
            module.set_custom_reduce_scatter(GlooLikeReduceScatter())


_STAGING = "_fsdpkit_gloo_staging"


@contextlib.contextmanager
def ring_gloo_buffers(*, active: bool) -> Iterator[None]:
    """Ring attention's k / v all-gathers allocate gloo's flattened input and hold its
    gathering temporary until the first wait (see the module docstring); nothing
    changes unless ``active`` (CPU ranks under ring attention)."""
    if not active:
        yield
        return
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _AllGatherRotater as Rotater,
    )

    exchange, wait = Rotater.exchange_buffers, Rotater.next_buffer

    def exchange_buffers(self: Any, curr_buffer: torch.Tensor) -> None:
        first = self._aggregated_buffer is None  # torch's rotater gathers only once
        if first:
            flat = torch.empty_like(curr_buffer)  # gloo's flattened copy of the input
            del flat
        exchange(self, curr_buffer)
        if first:  # the worker thread's temporary, until the first wait
            setattr(self, _STAGING, torch.empty_like(self._aggregated_buffer))

    def next_buffer(self: Any) -> torch.Tensor:
        if hasattr(self, _STAGING):
            delattr(self, _STAGING)
        return wait(self)  # type: ignore[no-any-return]

    Rotater.exchange_buffers, Rotater.next_buffer = exchange_buffers, next_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        Rotater.exchange_buffers, Rotater.next_buffer = exchange, wait  # type: ignore[method-assign]


class UnitTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that instruments each FSDP unit once: a unit of several
    modules (``fully_shard([b0, b1, b2])``) gets group forward hooks, as FSDP2 itself
    registers them, instead of one reshard per module (see the module docstring)."""

    def _units(self) -> list[tuple[FSDPModule, Any]]:
        units: dict[int, tuple[FSDPModule, Any]] = {}
        for module in self._root_mod.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                if state._fsdp_param_group is not None:
                    units.setdefault(id(state), (module, state))
        return list(units.values())

    def _hook(self, state: Any, pre: Any, post: Any) -> None:
        modules = state._modules
        if len(modules) == 1:
            state._pre_forward_hook_handle = modules[0].register_forward_pre_hook(
                pre, prepend=True, with_kwargs=True
            )
            state._post_forward_hook_handle = modules[0].register_forward_hook(
                post, prepend=False, always_call=True
            )
            return
        handle = _register_group_forward_hooks(
            modules, pre, post, state._modules_to_run_forward, state._cast_output_dtype
        )
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle

    def _instrument_fsdp_module(self) -> None:
        for _module, state in self._units():
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        for module, state in self._units():
            group = state._fsdp_param_group
            self._instrument_fsdp_sharded_params_grads(group)
            self._hook(
                state,
                self._fsdp_state_pre_forward(module, state._pre_forward),
                self._fsdp_state_post_forward(module, state._post_forward),
            )
            self._fsdp_mod_to_saved_methods[module] = _SavedFSDPMethods(
                group.pre_backward, group.post_backward
            )
            group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for module, saved in self._fsdp_mod_to_saved_methods.items():
            state = module._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            self._hook(state, state._pre_forward, state._post_forward)
            state._fsdp_param_group.pre_backward = saved.pre_backward
            state._fsdp_param_group.post_backward = saved.post_backward
        self._fsdp_mod_to_saved_methods.clear()
        if self._optimizer_hook_handles is not None:
            for handle in self._optimizer_hook_handles:
                handle.remove()
            self._optimizer_hook_handles = None

    def _fsdp_param_group_post_backward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        """torch's wrapper of FSDP2's post-backward (tag the unit's gradients unsharded,
        snapshot, run it, tag them sharded, snapshot), with the tagging in a function
        of its own so that no gradient outlives it (see the module docstring)."""

        @functools.wraps(orig)
        def inner(*args: Any, **kwargs: Any) -> None:
            stats = self.memory_tracking[fsdp_mod]
            self._tag_grads(fsdp_mod, sharded=False)
            stats.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(
                self.get_tracker_snapshot()
            )
            self._fsdp_state = _FSDPState.POST_BW
            orig(*args, **kwargs)
            self._tag_grads(fsdp_mod, sharded=True)
            stats.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(
                self.get_tracker_snapshot()
            )

        return inner

    def _tag_grads(self, fsdp_mod: FSDPModule, *, sharded: bool) -> None:
        """Count the unit's gradients as unsharded (before its post-backward) or
        sharded (after it)."""
        group = fsdp_mod._get_fsdp_state()._fsdp_param_group
        if group is None:
            return
        kind = _FSDPRefType.SHARDED_GRAD if sharded else _FSDPRefType.UNSHARDED_GRAD
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param if sharded else fsdp_param._unsharded_param
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, kind, update_existing=True)


class StagesTracker(UnitTracker):
    """``UnitTracker`` over a pipeline rank's stages: each stage is an FSDP root of its
    own (fsdpkit.sharding.pipeline.stages), so the tracker instruments the units of all
    of them and counts torch's receive buffers, which the schedule made in an earlier
    step, from the start ([Note: traced pipeline plans] in fsdpkit.planner.pipeline.traced)."""

    def __init__(
        self,
        stages: list[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        *,
        held: tuple[torch.Tensor, ...],
    ) -> None:
        super().__init__(stages[0], optimizer)  # torch's tracker takes one FSDP root
        self._root_mod = torch.nn.ModuleList(stages)  # type: ignore[assignment]
        self.track_inputs(held)
