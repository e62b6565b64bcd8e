"""FSDP2's per-unit mechanics in the planner's step replay: what each unit's all-gather,
copy-out, resharding, reduce-scatter and no-sync accumulation allocate and free, on the
ledger of one rank. ``fsdpkit.planner.replay.walk.Step`` strings them into a step's regions
(forward, backward, optimizer); the pipeline replay reuses them per stage.
"""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.planner.model.unit_layout import Unit
from fsdpkit.planner.replay.blockmem import GRAD, Sizes
from fsdpkit.planner.replay.gradlife import last_grad_bytes
from fsdpkit.planner.replay.ledger import Ledger
from fsdpkit.planner.replay.sizing import head_sizes, kept_embedding, rope_held, sizes
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import leading_frozen_units
from fsdpkit.sharding.policy import effective_reshard

COLL, UNSH = "collective_buffers", "unsharded_params"
CPU_RNG_STATE = 5056
"""Bytes of ``torch.get_rng_state()`` (the Mersenne Twister's state), torch 2.13."""


class UnitMechanics:
    """One rank's ledger and the state of its FSDP units during a replayed step."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.s = sizes(sc)
        self.frozen_s = replace(self.s, norm_grads=False, frozen_linears=True)
        """A block unit's sizes when all its weights are frozen (``sizes_of``)."""
        self.hs = head_sizes(sc)
        assert sc.model is not None
        self.m = sc.model
        self.led = Ledger()
        self.root, self.units = sc.root, sc.units
        self.host_states = sc.offload and sc.device.kind == "gpu"
        self.held: dict[str, int] = {}  # unit -> bytes of its unsharded params on the device
        self.prefetched: dict[str, int] = {}  # unit -> bytes of its all-gather output
        self.accumulated: dict[str, int] = {}  # unit -> bytes of no-sync accumulated grads
        self.sharded_grads: set[str] = set()  # units whose sharded grad exists (every)
        self.partial: dict[str, int] = {}  # unit -> HSDP partial reduce-scatter sum (every)
        self.last_micro = True  # whether the current backward is the step's last one
        self.fwd_flat = 0  # forward all-gather output kept until the next copy-out
        self.rs_state = 0  # reduce-scatter input kept until the next post-backward
        # Flash-attention backward on CUDA accumulates dq in fp32 and keeps a softmax
        # row sum (FA2 in PyTorch); so does the CPU kernel (measured: 1.5 Q in fp32),
        # counted where it sets the peak: inside ring attention's steps.
        gpu = sc.device.kind == "gpu"
        ws = self.s.nqe * 4 // self.s.e + self.s.nh4
        self.sdpa_workspace = ws if gpu or (self.s.ring and sc.dims.cp > 1) else 0
        # gloo (CPU ranks) all-gathers into a temporary of the output's size and
        # reduce-scatters a clone of the input; NCCL needs neither.
        self.gloo = not gpu and sc.dims.fsdp_shard > 1
        self.dead = leading_frozen_units(sc)
        self.input_frozen = "embedding" in sc.layout.frozen_names
        """The first block's input needs no gradient (a frozen embedding): the first
        unit after the ``dead`` ones starts the graph."""
        self.selective = sc.ac_mode == "selective"
        self.rope, self.kept_embedding = rope_held(sc), kept_embedding(sc)
        # [Note: the checkpoint's RNG state] torch's checkpoint saves the CPU generator's
        # state (a 5056-byte tensor) per checkpointed block until its recompute: device
        # memory on CPU ranks, where it adds up over a pipeline's micro-batches in flight
        self.rng_state = CPU_RNG_STATE if not gpu else 0

    def sizes_of(self, u: Unit) -> Sizes:
        """The sizes a block unit's events run over: a unit with nothing to train
        (``model.freeze``; LoRA's units hold trainable adapters) saves less."""
        return self.frozen_s if u.grads_numel == 0 else self.s

    def fresh(self, j: int, i: int) -> bool:
        """Whether block ``i`` of unit ``j`` is the first whose input needs no gradient
        (``fresh`` of fsdpkit.planner.replay.blockmem.block_forward): the first block of
        the first live unit after a frozen embedding."""
        return self.input_frozen and j == self.dead and i == 0

    def reshard_of(self, u: Unit) -> bool | int:
        """What FSDP2 does with the unit's ``reshard_after_forward`` after forward."""
        return effective_reshard(u.reshard_after_forward, shard=self.sc.dims.fsdp_shard)

    def unshard(self, u: Unit, *, forward: bool) -> None:
        """All-gather (or finish a prefetched one) and copy out into the parameters."""
        full = u.gathered * self.s.e
        flat = self.prefetched.pop(u.name, 0)
        if not flat and self.sc.dims.fsdp_shard > 1:
            flat = full
            self.all_gather(flat)
        if forward:  # the previous forward all-gather output dies at this copy-out
            self.led.add(COLL, -self.fwd_flat)
            self.fwd_flat = flat
        self.led.add(UNSH, full - self.held.pop(u.name, 0))
        self.held[u.name] = full
        if not forward:
            self.led.add(COLL, -flat)

    def prefetch(self, u: Unit) -> None:
        """Backward prefetch: issue the all-gather of the unit backward needs next."""
        full = u.gathered * self.s.e
        needed = self.held.get(u.name, 0) < full and u.name not in self.prefetched
        if needed and self.sc.dims.fsdp_shard > 1:
            self.prefetched[u.name] = full
            self.all_gather(full)

    def forward_prefetch(self, first: int) -> None:
        """Explicit forward prefetch: the next ``forward_prefetch`` block units from
        ``first`` on, right after the current unit's copy-out (none by default)."""
        for ahead in self.units[first : first + self.sc.forward_prefetch]:
            self.prefetch(ahead)

    def all_gather(self, flat: int) -> None:
        """FSDP2's flat output, plus gloo's transient copy of it."""
        self.led.add(COLL, flat)
        if self.gloo:
            self.led.apply([(COLL, flat), (COLL, -flat)])

    def reshard_after_forward(self, u: Unit, raf: bool | int) -> None:
        if raf is False or u.name not in self.held:  # an empty root never all-gathers
            return
        keep = 0 if raf is True else self.held[u.name] // int(raf)
        self.led.add(UNSH, keep - self.held[u.name])
        self.held[u.name] = keep

    def post_backward(self, u: Unit, *, sync: bool, in_place: bool = False) -> None:
        """Reshard, then reduce-scatter the unit's grads (or keep them, no-sync). Only
        trainable parameters have grads; a unit without any only reshards, and, as FSDP2
        does, not while ``keep_unsharded`` holds every unit until the step's last
        backward (a pipeline stage's frozen LoRA head stays gathered between its
        micro-batches). ``in_place``: this backward summed its grads into the
        accumulated ones ([Note: accumulating in place])."""
        e, rb = self.s.e, self.sc.reduce_bytes
        new_grads = 0 if in_place else u.grads_numel * e
        if not u.grads_numel:
            if not self.sc.keep_unsharded or (sync and self.last_micro):
                self.led.add(UNSH, -self.held.pop(u.name, 0))
            return
        if not sync:
            self._accumulate(u, new_grads)
            if not self.sc.keep_unsharded:
                self.led.add(UNSH, -self.held.pop(u.name, 0))
            return
        gathered = u.grads_sharded * self.sc.dims.fsdp_shard  # the reduce-scatter input
        self.led.add(COLL, -self.rs_state)  # the previous unit's input is released
        if self.last_micro or not self.sc.keep_unsharded:  # else kept for the next forward
            self.led.add(UNSH, -self.held.pop(u.name, 0))
        last = last_grad_bytes(sc=self.sc, s=self.s, unit=u, accumulated=u.name in self.accumulated)
        self.led.add(COLL, gathered * rb)  # copy-in, then the grads are freed
        self.led.add(GRAD, -new_grads - self.accumulated.pop(u.name, 0) + last)
        self.rs_state = gathered * rb
        gloo = gathered * rb if self.gloo else 0  # gloo reduces a clone of the input
        if self.sc.dims.replicate > 1 and not self.last_micro:
            self._partial_sum(u, gloo)
        else:
            self._reduced(u, gloo)
        self.led.add(GRAD, -last)

    def _reduced(self, u: Unit, gloo: int) -> None:
        """The reduce-scatter output becomes the sharded gradient, or (``every``, after
        the first micro-batch) is added into it; an HSDP partial sum is added in and dies."""
        rb, out = self.sc.reduce_bytes, u.grads_sharded * self.sc.reduce_bytes
        exists = u.name in self.sharded_grads
        if rb == 4:
            self.led.apply([("gradients", out), (COLL, gloo), (COLL, -gloo)])
            self.led.add("gradients", -self.partial.pop(u.name, 0))
        else:  # reduced in bf16, then cast to the fp32 sharded grad
            self.led.apply([(COLL, out + gloo), (COLL, -gloo)])
            self.led.add("gradients", -self.partial.pop(u.name, 0))
            self.led.apply([("gradients", u.grads_sharded * 4), (COLL, -out)])
        if exists or self.host_states:  # added into the existing grad / copied to the host
            self.led.add("gradients", -u.grads_sharded * 4)
        self.sharded_grads.add(u.name)

    def _partial_sum(self, u: Unit, gloo: int) -> None:
        """HSDP with ``every``, before the last micro-batch: no all-reduce, FSDP2 keeps
        the sum of the reduce-scatter outputs (reduce dtype) and makes no grad yet."""
        out = u.grads_sharded * self.sc.reduce_bytes
        if u.name not in self.partial:
            self.partial[u.name] = out
            self.led.apply([("gradients", out), (COLL, gloo), (COLL, -gloo)])
        else:
            self.led.apply([(COLL, out + gloo), (COLL, -gloo), (COLL, -out)])

    def _accumulate(self, u: Unit, new_grads: int) -> None:
        """No-sync micro-batch: grads stay unsharded, in the reduce dtype."""
        if u.name in self.accumulated:
            self.led.add(GRAD, -new_grads)  # added into the existing accumulator
        elif self.s.e != self.sc.reduce_bytes:
            self.accumulated[u.name] = u.grads_numel * self.sc.reduce_bytes
            self.led.apply([(GRAD, self.accumulated[u.name]), (GRAD, -new_grads)])
        else:
            self.accumulated[u.name] = new_grads
