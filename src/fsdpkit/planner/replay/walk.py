"""The replay of one FSDP2 training step over a scenario's units, into a ``Ledger``.

What each allocation and free models, and why: the docstring of
fsdpkit.planner.replay.analytic (the entry point) and docs/planner.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fsdpkit.planner.model.unit_layout import Unit
from fsdpkit.planner.replay.blockmem import (
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
from fsdpkit.planner.replay.fsdpunits import COLL, UnitMechanics
from fsdpkit.planner.replay.gradlife import grads_in_place, transient_grads
from fsdpkit.planner.replay.grpohead import grpo_loss_backward, grpo_loss_forward
from fsdpkit.planner.replay.headmem import (
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
from fsdpkit.planner.replay.ledger import EventSummary, summarize
from fsdpkit.planner.shapes.states import model_states


@functools.cache
def _forward_summary(
    s: Sizes, keep: bool, selective: bool = False, fresh: bool = False
) -> EventSummary:
    return summarize(block_forward(s, keep=keep, selective=selective, fresh=fresh))


@functools.cache
def _backward_summary(
    s: Sizes,
    recompute: bool,
    sdpa_workspace: int,
    weight_grads: bool = True,
    selective: bool = False,
    in_place: bool = False,
    received: bool = False,
    fresh: bool = False,
) -> EventSummary:
    """``weight_grads=False``: a block with frozen weights (fine-tuning) computes no
    weight gradients; its trainable ones (adapters) are added by the caller.
    ``selective``: the recompute of a selectively checkpointed block. ``in_place``:
    its weight gradients are summed into accumulated ones ([Note: accumulating in
    place]). ``received``: its output's grad is a pipeline stage's receive buffer.
    ``fresh``: its input needs no gradient (``block_forward``)."""
    events = block_recompute(s, selective=selective) if recompute else []
    events += block_backward(s, sdpa_workspace=sdpa_workspace, held=int(received), fresh=fresh)
    if recompute and selective:
        events += selective_backward_end(s)
    if recompute and s.cast:
        events.append((ACT, -s.nde))  # the checkpointed input (fp32: freed as xf above)
    if not weight_grads:
        events = [(c, n) for c, n in events if c != GRAD]
    elif in_place:
        events = transient_grads(events)
    return summarize(events)


@dataclass(frozen=True)
class BlockPass:
    """One block's backward as ``Step.unit_backward`` asks for it (the arguments of
    ``_backward_summary`` that vary by block)."""

    s: Sizes
    """``sizes_of`` the block's unit."""
    recompute: bool
    """Checkpointed: its forward runs again first."""
    weight_grads: bool
    """Every weight trains (else only the adapters', added by the caller)."""
    in_place: bool
    received: bool
    fresh: bool


_LOSS_WHERE = {
    False: "loss (logits.float(), log-softmax)",
    True: "loss backward (log-softmax grad)",
}
_GRPO_WHERE = {
    False: "GRPO loss (completion logits, log-probs, entropy)",
    True: "GRPO loss backward (log-probs, completion logits)",
}


class Step(UnitMechanics):
    """One steady-state step; each method is a region of it."""

    def persistent(self) -> None:
        """Sharded params and optimizer states (device or host), buffers, the batch."""
        led = self.led
        if not self.host_states:
            for category, value in model_states(self.sc).items():
                if category != "gradients":
                    led.add(category, value)
        led.add("buffers_inputs", self.sc.layout.buffer_bytes)  # RoPE tables or frequencies
        grpo, rows, gpu = self.sc.grpo, self.sc.micro_batch, self.sc.device.kind == "gpu"
        tokens = rows * (self.sc.seq_len + 1) * 8
        # or GRPO's rollout micro-batches ([Note: the GRPO step in the plan])
        led.add("buffers_inputs", tokens if grpo is None else grpo.batch_bytes(rows, copied=gpu))

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
        led, s = self.led, self.sizes_of(u)
        led.at("forward", f"forward of {u.name}")
        self.gathered(u, forward=True)
        self.forward_prefetch(j + 1)
        for i, ckpt in enumerate(u.checkpointed):
            keep = not ckpt and j >= self.dead
            selective = ckpt and self.selective and j >= self.dead
            led.apply_summary(_forward_summary(s, keep, selective, keep and self.fresh(j, i)))
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
            led.apply(self.loss_events(backward=False))

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
            led.apply(self.loss_events(backward=True))
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

    def loss_events(self, *, backward: bool) -> list[Event]:
        """The full-logits loss's forward, or its backward (ending with the logits'
        gradient live): cross-entropy, or GRPO's ([Note: GRPO loss head memory])."""
        phase = "backward" if backward else "forward"
        grpo = self.sc.grpo
        if grpo is None:
            self.led.at(phase, _LOSS_WHERE[backward])
            return loss_backward(self.hs) if backward else loss_forward(self.hs)
        self.led.at(phase, _GRPO_WHERE[backward])
        events = grpo_loss_backward if backward else grpo_loss_forward
        return events(self.hs, grpo, rows=self.sc.micro_batch)

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
        last = len(u.checkpointed) - 1
        for i, ckpt in enumerate(reversed(u.checkpointed)):
            fresh = not ckpt and self.fresh(j, last - i)
            block = BlockPass(self.sizes_of(u), ckpt, full, in_place, received and i == 0, fresh)
            led.apply_summary(self.block_summary(block))
            if ckpt:
                led.add(ACT, -self.rng_state)
        if not full:
            led.add(GRAD, u.grads_numel * s.e)
        if j == self.dead:  # the last block backward that reads RoPE's cos / sin
            led.add("buffers_inputs", -self.rope)
        self.post_backward(u, sync=sync, in_place=in_place)

    def block_summary(self, b: BlockPass) -> EventSummary:
        """One block's backward (``_backward_summary``), as ``unit_backward`` applies it."""
        args = (self.sdpa_workspace, b.weight_grads, self.selective, b.in_place, b.received)
        return _backward_summary(b.s, b.recompute, *args, b.fresh)

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
