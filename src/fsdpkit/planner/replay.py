"""The replay of one FSDP2 training step over a scenario's units, into a ``Ledger``.

What each allocation and free models, and why: the docstring of
fsdpkit.planner.analytic (the entry point) and docs/planner.md.
"""

from __future__ import annotations

import functools

from fsdpkit.planner.blockmem import (
    ACT,
    GRAD,
    LOGITS,
    TEMP,
    Event,
    Sizes,
    block_backward,
    block_forward,
    block_recompute,
    selective_backward_end,
)
from fsdpkit.planner.gradlife import grads_in_place, last_grad_bytes, transient_grads
from fsdpkit.planner.headmem import (
    chunked_head_forward,
    chunked_loss_backward,
    chunked_loss_forward,
    embedding_backward,
    embedding_grad_gather,
    embedding_output,
    final_norm_backward,
    head_backward,
    hidden_gather,
    hidden_grad_scatter,
    loss_backward,
    loss_forward,
)
from fsdpkit.planner.layout import Unit
from fsdpkit.planner.ledger import EventSummary, Ledger, summarize
from fsdpkit.planner.scenario import Scenario
from fsdpkit.planner.sizing import head_sizes, kept_embedding, rope_held, sizes
from fsdpkit.planner.states import leading_frozen_units, model_states
from fsdpkit.sharding.policy import effective_reshard

COLL, UNSH = "collective_buffers", "unsharded_params"
CPU_RNG_STATE = 5056
"""Bytes of ``torch.get_rng_state()`` (the Mersenne Twister's state), torch 2.13."""


@functools.cache
def _forward_summary(s: Sizes, keep: bool, selective: bool = False) -> EventSummary:
    return summarize(block_forward(s, keep=keep, selective=selective))


@functools.cache
def _backward_summary(
    s: Sizes,
    recompute: bool,
    sdpa_workspace: int,
    weight_grads: bool = True,
    selective: bool = False,
    in_place: bool = False,
    received: bool = False,
) -> EventSummary:
    """``weight_grads=False``: a block with frozen weights (fine-tuning) computes no
    weight gradients; its trainable ones (adapters) are added by the caller.
    ``selective``: the recompute of a selectively checkpointed block. ``in_place``:
    its weight gradients are summed into accumulated ones ([Note: accumulating in
    place]). ``received``: its output's grad is a pipeline stage's receive buffer."""
    events = block_recompute(s, selective=selective) if recompute else []
    events += block_backward(s, sdpa_workspace=sdpa_workspace, held=int(received))
    if recompute and selective:
        events += selective_backward_end(s)
    if recompute and s.cast:
        events.append((ACT, -s.nde))  # the checkpointed input (fp32: freed as xf above)
    if not weight_grads:
        events = [(c, n) for c, n in events if c != GRAD]
    elif in_place:
        events = transient_grads(events)
    return summarize(events)


class Step:
    """One steady-state step; each method is a region of it."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.s = sizes(sc)
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
        self.sdpa_workspace = ws if gpu or (self.s.ring and sc.cp > 1) else 0
        # gloo (CPU ranks) all-gathers into a temporary of the output's size and
        # reduce-scatters a clone of the input; NCCL needs neither.
        self.gloo = not gpu and sc.shard > 1
        self.dead = leading_frozen_units(sc)
        self.selective = sc.ac_mode == "selective"
        self.rope, self.kept_embedding = rope_held(sc), kept_embedding(sc)
        # [Note: the checkpoint's RNG state] torch's checkpoint saves the CPU generator's
        # state (a 5056-byte tensor) per checkpointed block until its recompute: device
        # memory on CPU ranks, where it adds up over a pipeline's micro-batches in flight
        self.rng_state = CPU_RNG_STATE if not gpu else 0

    # ------------------------------------------------------------ unit mechanics

    def reshard_of(self, u: Unit) -> bool | int:
        """What FSDP2 does with the unit's ``reshard_after_forward`` after forward."""
        return effective_reshard(u.reshard_after_forward, shard=self.sc.shard)

    def unshard(self, u: Unit, *, forward: bool) -> None:
        """All-gather (or finish a prefetched one) and copy out into the parameters."""
        full = u.gathered * self.s.e
        flat = self.prefetched.pop(u.name, 0)
        if not flat and self.sc.shard > 1:
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
        if needed and self.sc.shard > 1:
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
        trainable parameters have grads; a unit without any only reshards. ``in_place``:
        this backward summed its grads into the accumulated ones ([Note: accumulating
        in place])."""
        e, rb = self.s.e, self.sc.reduce_bytes
        new_grads = 0 if in_place else u.grads_numel * e
        if not u.grads_numel:
            self.led.add(UNSH, -self.held.pop(u.name, 0))
            return
        if not sync:
            self._accumulate(u, new_grads)
            if not self.sc.keep_unsharded:
                self.led.add(UNSH, -self.held.pop(u.name, 0))
            return
        gathered = u.grads_sharded * self.sc.shard  # the reduce-scatter input
        self.led.add(COLL, -self.rs_state)  # the previous unit's input is released
        if self.last_micro or not self.sc.keep_unsharded:  # else kept for the next forward
            self.led.add(UNSH, -self.held.pop(u.name, 0))
        last = last_grad_bytes(sc=self.sc, s=self.s, unit=u, accumulated=u.name in self.accumulated)
        self.led.add(COLL, gathered * rb)  # copy-in, then the grads are freed
        self.led.add(GRAD, -new_grads - self.accumulated.pop(u.name, 0) + last)
        self.rs_state = gathered * rb
        gloo = gathered * rb if self.gloo else 0  # gloo reduces a clone of the input
        if self.sc.replicate > 1 and not self.last_micro:
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

    # ------------------------------------------------------------------ regions

    def persistent(self) -> None:
        """Sharded params and optimizer states (device or host), buffers, the batch."""
        led = self.led
        if not self.host_states:
            for category, value in model_states(self.sc).items():
                if category != "gradients":
                    led.add(category, value)
        led.add("buffers_inputs", self.sc.layout.buffer_bytes)  # RoPE tables or frequencies
        led.add("buffers_inputs", self.sc.micro_batch * (self.sc.seq_len + 1) * 8)  # tokens

    def gathered(self, u: Unit | None, *, forward: bool) -> None:
        """A unit's pre-forward / pre-backward: all-gather unless it is still unsharded."""
        if u is not None and self.held.get(u.name, 0) < u.gathered * self.s.e:
            self.unshard(u, forward=forward)

    def forward(self) -> None:
        self.led.at("forward", "root unit all-gather and embedding")
        self.gathered(self.root, forward=True)
        self.forward_prefetch(0)
        self.embedding_forward()
        for j, u in enumerate(self.units):
            self.unit_forward(j, u)
        self.head_and_loss_forward()

    def embedding_forward(self) -> None:
        """The embedding's output, in the embedding unit (then resharded like a block
        unit) or the root's."""
        s, embedding = self.s, self.sc.edge("embedding")
        self.gathered(embedding, forward=True)
        kept = embedding_output(s, self.hs, kept=self.kept_embedding > 0)
        self.led.apply([("buffers_inputs", self.rope), *kept])
        if embedding is not None:
            self.reshard_after_forward(embedding, self.reshard_of(embedding))

    def unit_forward(self, j: int, u: Unit) -> None:
        led, s = self.led, self.s
        led.at("forward", f"forward of {u.name}")
        self.gathered(u, forward=True)
        self.forward_prefetch(j + 1)
        for ckpt in u.checkpointed:
            keep = not ckpt and j >= self.dead
            selective = ckpt and self.selective and j >= self.dead
            led.apply_summary(_forward_summary(s, keep, selective))
            if ckpt and j >= self.dead:
                led.add(ACT, self.rng_state)
            if j < self.dead:  # nothing needs a gradient yet: the input dies here
                led.add(ACT, -s.nde)
        self.reshard_after_forward(u, self.reshard_of(u))

    def head_and_loss_forward(self) -> None:
        """Final norm and head (in their units, kept unsharded, or the root's), the
        loss, and the root's post-forward."""
        led, s = self.led, self.hs
        led.at("forward", "final norm and output head")
        chunk, head = self.sc.loss_chunk, self.sc.edge("head")
        if head is not None:
            self.gathered(self.sc.edge("norm"), forward=True)
        # the final norm runs on the rank's sequence shard (SequenceParallel); its output
        # is all-gathered for the head ([Note: model-parallel block memory])
        led.apply(chunked_head_forward(self.s))
        led.apply(hidden_gather(self.s, s))
        led.add(ACT, -self.kept_embedding)  # transformers' body returns
        if head is not None:
            self.gathered(head, forward=True)
        led.add(LOGITS, s.nve if chunk is None else 0)
        if chunk is not None:  # inside the root's forward ([Note: the loss inside ...])
            led.at("forward", f"chunked loss ({chunk}-token chunks)")
            led.apply(chunked_loss_forward(s, chunk=chunk))
        led.add(COLL, -self.fwd_flat)  # the root's post-forward frees the last one
        self.fwd_flat = 0
        self.reshard_after_forward(self.root, self.reshard_of(self.root))
        if chunk is None:
            led.at("forward", "loss (logits.float(), log-softmax)")
            led.apply(loss_forward(s))

    def backward(self, *, sync: bool) -> None:
        self.loss_and_head_backward(sync=sync)
        for j in reversed(range(self.dead, len(self.units))):
            self.unit_backward(j, sync=sync)
        self.embedding_and_root_backward(sync=sync)

    def loss_and_head_backward(self, *, sync: bool) -> None:
        """The loss and head's backward; a head unit reduce-scatters right after it, and
        the norm unit's post-backward after the final norm's releases that buffer."""
        led, s = self.led, self.hs
        chunk = self.sc.loss_chunk
        if chunk is None:
            led.at("backward", "loss backward (log-softmax grad)")
            led.apply(loss_backward(s))
        led.at("backward", "output head backward" if chunk is None else "chunked loss backward")
        self.gathered(self.root, forward=False)
        for ahead in self.units[::-1][: self.sc.backward_prefetch]:
            self.prefetch(ahead)
        head = self.sc.edge("head")
        led.apply(self.head_events(weight_grad="head" not in self.sc.layout.frozen_names))
        # back to the shard the norm ran on, inside the head unit's backward: FSDP2's
        # hook sees the head's input before tensor parallelism gathers it
        led.apply(hidden_grad_scatter(self.s, s))
        if head is not None:
            self.post_backward(head, sync=sync)
        led.apply(self.final_norm_events())
        norm_unit = self.sc.edge("norm")
        if head is not None and norm_unit is not None:
            self.post_backward(norm_unit, sync=sync)

    def head_events(self, *, weight_grad: bool) -> list[Event]:
        """The head's backward with the loss's (chunked or not) in ``loss_and_head_backward``."""
        s, chunk = self.hs, self.sc.loss_chunk
        if chunk is None:
            return head_backward(s, weight_grad=weight_grad, norm=False)
        return chunked_loss_backward(s, chunk=chunk, weight_grad=weight_grad, norm=False)

    def final_norm_events(self) -> list[Event]:
        """The final norm's backward in ``loss_and_head_backward``."""
        return final_norm_backward(self.s)

    def embedding_and_root_backward(self, *, sync: bool) -> None:
        """The embedding's backward (in its unit, prefetched by the first block unit,
        or the root's), the root's post-backward, FSDP2's final callback."""
        led, s = self.led, self.s
        led.at("backward", "embedding backward and root reduce-scatter")
        embedding = self.sc.edge("embedding")
        if "embedding" in self.sc.layout.frozen_names:  # autograd stops at its output
            led.add(TEMP, -s.nde)
        else:
            self.gathered(embedding, forward=False)
            # split by vocabulary, both grads are DTensors: autograd sums a tensor
            # subclass's grads out of place (fsdpkit.loss.chunked_ce, grad_into_weight)
            in_place = self.sc.loss_chunk is not None and not self.sc.vocab_parallel
            tied = self.m.tie_embeddings
            grad = embedding_grad_gather(s, self.hs)
            split = s.vocab // self.hs.vocab  # tp when the head's rows are split
            led.apply(grad + embedding_backward(self.hs, tied=tied, in_place=in_place, split=split))
            if embedding is not None:
                self.post_backward(embedding, sync=sync)
        self.post_backward(self.root, sync=sync)
        for flat in self.prefetched.values():  # prefetched for a unit backward skipped:
            led.add(COLL, -flat)  # freed when FSDP2's final callback reshards everything
        self.prefetched.clear()
        if self.dead == len(self.units):  # no block backward freed RoPE's tensors
            led.add("buffers_inputs", -self.rope)
        led.add(COLL, -self.rs_state)
        self.rs_state = 0

    def unit_backward(self, j: int, *, sync: bool, received: bool = False) -> None:
        """``received``: the gradient of the unit's output is a pipeline stage's
        receive buffer (its last block's backward starts from it)."""
        led, s, u = self.led, self.s, self.units[j]
        led.at("backward", f"backward of {u.name}")
        self.gathered(u, forward=False)
        # FSDP2 prefetches by forward order, a unit backward skips included; the first
        # block unit's list is empty, so it prefetches implicitly: the embedding unit
        for ahead in self.units[max(j - self.sc.backward_prefetch, 0) : j][::-1]:
            self.prefetch(ahead)
        embedding = self.sc.edge("embedding")
        if j == 0 and embedding is not None:
            self.prefetch(embedding)
        full = u.grads_numel == u.numel  # else frozen weights: only trainable grads
        in_place = full and grads_in_place(
            sc=self.sc, s=self.s, accumulated=u.name in self.accumulated
        )
        for i, ckpt in enumerate(reversed(u.checkpointed)):
            led.apply_summary(self.block_summary(ckpt, full, in_place, received and i == 0))
            if ckpt:
                led.add(ACT, -self.rng_state)
        if not full:
            led.add(GRAD, u.grads_numel * s.e)
        if j == self.dead:  # the last block backward that reads RoPE's cos / sin
            led.add("buffers_inputs", -self.rope)
        self.post_backward(u, sync=sync, in_place=in_place)

    def block_summary(
        self, ckpt: bool, weight_grads: bool, in_place: bool, received: bool
    ) -> EventSummary:
        """One block's backward (``_backward_summary``), as ``unit_backward`` applies it."""
        args = (self.sdpa_workspace, weight_grads, self.selective, in_place, received)
        return _backward_summary(self.s, ckpt, *args)

    def optimizer(self) -> None:
        """Grad clipping (scalars) and AdamW as fsdpkit.train builds it, the 2-D weights
        in one group: foreach allocates sqrt(v) for all of them, for-loop sqrt(v) and
        its quotient for one parameter at a time, fused nothing."""
        impl = self.sc.optimizer_impl
        self.led.at("optimizer step", f"AdamW step ({impl})")
        every = self.sc.all_units
        temp = 0
        if impl == "foreach":
            temp = 4 * sum(u.grads_matrix_sharded for u in every)
        elif impl == "for-loop":
            temp = 2 * 4 * max(u.largest_sharded for u in every)
        if not self.host_states:
            self.led.apply([(TEMP, temp), (TEMP, -temp)])
