"""One pipeline rank's step replayed into a ledger: its stages' FSDP2 units as torch's
schedule drives them, action by action ([Note: pipeline plans] in
fsdpkit.planner.pipeline.plan).

[Note: what a pipeline stage holds]
Besides what a stage's blocks, embedding, head and loss hold as in any step
(fsdpkit.planner.replay.walk), measured on torch 2.13's PipelineStage with an FSDP2 stage
module ([Note: FSDP inside a stage] in fsdpkit.sharding.pipeline.stages):

- FSDP2 inside the stage: every backward but the stage's last runs without gradient
  reduction and without resharding, so after a stage's first backward its units'
  unsharded parameters stay until the next forward reshards them, and their unsharded
  gradients accumulate until the stage's REDUCE_GRAD reduce-scatters them all (the
  replay's ``last`` accumulation with parameters kept unsharded);
- a stage that receives hidden states keeps one receive buffer per micro-batch for
  the whole run (torch allocates them at the first step); a stage that sends hidden
  states keeps one gradient receive buffer per micro-batch, and its output in the
  schedule's cache from its forward to its backward;
- what a stage sends lives until the schedule drops the send ([Note: pipeline
  sends], ``send_releases``; torch drops the receive buffer's ``.grad`` at once);
- every rank holds the step's micro-batches of token ids (each stage reads them).

The backward of a stage that is not the last starts from the received gradient: the
receive buffer, which autograd cannot sum into, so the residual stream's gradient
becomes a new tensor at the last block's first residual sum (``block_backward``'s
``held``; counted at the backward's start instead, the middle stages' plans read
+0.5% in their first backward); the first block's backward frees its saved input,
which here is the persistent receive buffer (added back). Every backward after a
stage's first sums its weight gradients into the accumulated ones, each new one
alive until AccumulateGrad ([Note: accumulating in place] in
fsdpkit.planner.replay.gradlife). The zero-bubble schedules' I and W: [Note: zero-bubble
backward] in fsdpkit.planner.pipeline.zerobubble.
"""

from __future__ import annotations

from collections.abc import Callable

from fsdpkit.planner.model.unit_layout import Unit
from fsdpkit.planner.pipeline.zerobubble import split_backward, split_chunked_loss, split_events
from fsdpkit.planner.replay.analytic import late_free_spread
from fsdpkit.planner.replay.blockmem import ACT, TEMP, Event
from fsdpkit.planner.replay.fsdpunits import COLL
from fsdpkit.planner.replay.ledger import EventSummary, Ledger, summarize
from fsdpkit.planner.replay.walk import BlockPass, Step
from fsdpkit.planner.shapes.result import MemoryPlan
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import model_states, stages_states

Action = tuple[str, int, int]
WeightPass = EventSummary | Callable[[], None]
"""Part of a weight pass: events, or FSDP2 bookkeeping."""


class StageStep(Step):
    """One stage's units in a rank's shared ledger."""

    def __init__(
        self,
        sc: Scenario,
        *,
        stage: int,
        first: bool,
        last: bool,
        local: set[int],
        led: Ledger,
        tied: bool = False,
    ) -> None:
        """``local``: the rank's stages (a V schedule hands over between two of them);
        ``tied``: the model's head is its embedding."""
        super().__init__(sc.with_(keep_unsharded=True, accum_sync="last", grad_accum=2))
        self.led = led
        self.stage, self.first, self.last = stage, first, last
        if not first:  # torch makes a received input need a gradient: every block saves
            self.dead, self.input_frozen = 0, False
        self.local_next = not last and stage + 1 in local
        self.local_prev = not first and stage - 1 in local
        self.edge_names = {"head", "norm"}  # their units (``Scenario.edge``)
        self.head_in_root = tied and last and sc.root.grads_numel > 0
        """A tied head's copy in the stage's root ([Note: tied stages in the plan] in
        fsdpkit.planner.pipeline.tied): its gradient, and the final norm's, sum into the
        accumulated ones right after the head's backward, not at the stage's end."""
        if self.head_in_root:
            self.edge_names.add(sc.root.name)
        self.last_micro = False
        self.sending = 0
        """Bytes of the input gradient its last backward handed to an asynchronous send."""
        self.weight_passes: dict[int, list[WeightPass]] = {}
        """Per micro-batch, the weight passes its input pass left, in backward order
        ([Note: zero-bubble backward])."""
        self.splitting: list[WeightPass] | None = None

    def stage_persistent(self, *, micro_batches: int) -> None:
        """The stage's sharded states and buffers, and torch's receive buffers."""
        for category, value in model_states(self.sc).items():
            if category != "gradients":
                self.led.add(category, value)
        self.led.add("buffers_inputs", self.sc.layout.buffer_bytes)
        buffers = (not self.first) + (not self.last)
        self.led.add("buffers_inputs", buffers * micro_batches * self.s.nde)

    def forward_action(self) -> None:
        led = self.led
        led.at("forward", f"stage {self.stage} forward")
        self.gathered(self.root, forward=True)
        self.forward_prefetch(0)
        if self.first:
            self.embedding_forward()
        else:  # this stage's forward computes its own RoPE cos / sin
            led.add("buffers_inputs", self.rope)
        for j, u in enumerate(self.units):
            self.unit_forward(j, u)
        if self.last:
            self.head_and_loss_forward()
            return
        if self.local_next:  # [Note: pipeline sends]: the next stage's input from last step
            led.add("buffers_inputs", -self.s.nde)
        led.add(COLL, -self.fwd_flat)  # the stage root's post-forward
        self.fwd_flat = 0
        self.reshard_after_forward(self.root, self.reshard_of(self.root))

    def backward_action(self, *, keep_output: bool) -> None:
        """``keep_output``: the schedule's send of the stage's output outlives the
        backward ([Note: pipeline sends]), so the output is not freed here."""
        led = self.led
        if self.last:
            self.loss_and_head_backward(sync=False)
        for j in reversed(range(self.dead, len(self.units))):
            received = not self.last and j == len(self.units) - 1
            self.unit_backward(j, sync=False, received=received)
        if self.first:
            self.embedding_and_root_backward(sync=False)
        else:
            self._input_gradient()
        if not self.last and not keep_output:
            led.add(ACT, -self.s.nde)  # the stage's output leaves the schedule's cache

    def input_action(self, mb: int, *, keep_output: bool) -> None:
        """torch's I: the backward towards the stage's input, each block's weight pass
        kept for ``weight_action`` ([Note: zero-bubble backward])."""
        self.splitting = parts = self.weight_passes.setdefault(mb, [])
        try:
            self.backward_action(keep_output=keep_output)
        finally:
            self.splitting = None
        if self.head_in_root:  # its weight, named the embedding's, is the stage's first
            parts.append(parts.pop(0))  # parameter: its weight pass goes first

    def weight_action(self, mb: int) -> None:
        """torch's W: micro-batch ``mb``'s weight passes, in the parameters' order."""
        self.led.at("backward", f"stage {self.stage} weight gradients")
        for part in reversed(self.weight_passes.pop(mb)):
            if isinstance(part, EventSummary):
                self.led.apply_summary(part)
            else:
                part()
        if not self.first:
            self.led.add(ACT, self.s.nde)  # the receive buffer (see ``_input_gradient``)

    def loss_and_head_backward(self, *, sync: bool) -> None:
        super().loss_and_head_backward(sync=sync)
        if self.head_in_root:
            self.post_backward(self.root, sync=sync)

    def head_events(self, *, weight_grad: bool) -> list[Event]:
        events = super().head_events(weight_grad=weight_grad)
        if self.splitting is None:
            return events
        chunked = self.sc.loss_chunk is not None
        inputs, weights = split_chunked_loss(events, s=self.hs) if chunked else split_events(events)
        self.splitting.append(summarize(weights))
        return inputs

    def final_norm_events(self) -> list[Event]:
        events = super().final_norm_events()
        if self.splitting is None:
            return events
        inputs, weights = split_events(events)
        self.splitting.append(summarize(weights))
        return inputs

    def post_backward(self, u: Unit, *, sync: bool, in_place: bool = False) -> None:
        """Under the split, the head's and final norm's bookkeeping (their weight
        gradients) runs with their weight passes."""
        if self.splitting is not None and u.name in self.edge_names:
            self.splitting.append(lambda: super(StageStep, self).post_backward(u, sync=sync))
            return
        super().post_backward(u, sync=sync, in_place=in_place)

    def block_summary(self, b: BlockPass) -> EventSummary:
        if self.splitting is None:
            return super().block_summary(b)
        inputs, weights = split_backward(
            b.s,
            recompute=b.recompute,
            sdpa_workspace=self.sdpa_workspace,
            selective=self.selective,
            in_place=b.in_place,
            received=b.received,
            weight_grads=b.weight_grads,
            fresh=b.fresh,
        )
        self.splitting.append(weights)
        return inputs

    def _input_gradient(self) -> None:
        """The stage root's post-backward; the chain's gradient stays as the receive
        buffer's ``.grad``; the buffer itself, freed by the model as the first block's
        saved input, persists."""
        led = self.led
        led.at("backward", f"stage {self.stage} input gradient")
        if not self.head_in_root:
            self.post_backward(self.root, sync=False)
        for flat in self.prefetched.values():
            led.add(COLL, -flat)
        self.prefetched.clear()
        led.add(COLL, -self.rs_state)
        self.rs_state = 0
        if self.splitting is None:  # else freed (and added back) in the weight pass
            led.add(ACT, self.s.nde)
        self.sending = self.s.nde
        if self.local_prev:  # it replaces the previous stage's gradient of last step
            led.add("buffers_inputs", -self.s.nde)
            self.sending = 0
        if self.dead == len(self.units):
            led.add("buffers_inputs", -self.rope)

    def reduce_action(self) -> None:
        """torch's REDUCE_GRAD: every unit's post-backward with reduction and resharding."""
        self.led.at("backward", f"stage {self.stage} gradient reduce-scatter")
        self.last_micro = True
        for u in (*self.sc.forward_units, self.root):
            self.post_backward(u, sync=True, in_place=True)
        self.led.add(COLL, -self.rs_state)
        self.rs_state = 0


def send_releases(
    schedule: str, actions: tuple[Action, ...], *, local: set[int]
) -> dict[tuple[str, int, int], int]:
    """[Note: pipeline sends]
    A send's tensor lives until the schedule lets go of the send: the gloo (or NCCL)
    work of an isend holds its tensor until the work object is dropped, whether or not
    it was waited on. When that is, per send, in torch 2.13's schedules: for each
    ("output", stage, micro-batch) of a forward and ("grad", stage, micro-batch) of a
    backward (or I), the index in ``actions`` of the action after which it goes
    (``len(actions)``: the step's end, after REDUCE_GRAD).

    - Schedule1F1B keeps one work in ``send_work`` and one list of P2P ops in
      ``bwd_sends``: an input gradient goes after the stage's next backward (the last
      at the step's end); a warm-up forward's send is dropped by the next warm-up
      forward, except the one before the last warm-up forward (micro-batch ``w - 2`` of
      ``w`` warm-up forwards), whose work ``send_work`` holds until the steady phase
      ends, after the backward of micro-batch ``n - w`` (pp4's middle stages kept one
      hidden state more, from their 2nd backward on, until this rule was modelled);
      the other outputs go at their backward, as their cache entry does;
    - GPipe keeps every work in a list until the step returns;
    - the looped and V schedules (torch's schedule runtime) keep every send until
      the step's actions end.

    Two stages on one rank (``local``: the rank's stages; a V schedule's middle pair)
    send nothing: the stage after takes the output itself as its input and keeps it
    (a detached alias) until that micro-batch's next forward, a step later; the stage
    before takes the input gradient as its received gradient the same way. Each
    replaces last step's, so their memory is the receive buffers' (those are
    counted once, in ``stage_persistent``).
    """
    end = len(actions)
    if schedule != "1F1B":
        return {
            (what, stage, mb): end
            for kind, stage, mb in actions
            if (kind == "F" and stage + 1 not in local) or (kind in "BI" and stage - 1 not in local)
            for what in (("output",) if kind == "F" else ("grad",))
        }
    out: dict[tuple[str, int, int], int] = {}
    backwards: dict[int, list[int]] = {}
    for i, (kind, stage, _) in enumerate(actions):
        if kind == "B":
            backwards.setdefault(stage, []).append(i)
    for stage, at in backwards.items():
        for j, i in enumerate(at):
            out[("grad", stage, actions[i][2])] = at[j + 1] if j + 1 < len(at) else end
        warmup = sum(1 for kind, s, _ in actions[: at[0]] if kind == "F" and s == stage)
        if warmup >= 2:  # micro-batch n - w is the steady phase's last backward
            out[("output", stage, warmup - 2)] = at[len(at) - warmup]
    return out


def rank_memory(
    stages: dict[int, Scenario],
    actions: tuple[Action, ...],
    *,
    last_stage: int,
    micro_batches: int,
    schedule: str,
    tied: bool = False,
    twin: int = 0,
) -> MemoryPlan:
    """One pipeline rank's steady-state step ([Note: what a pipeline stage holds]):
    ``stages`` are its stages' scenarios by stage index, ``actions`` its schedule's;
    ``tied``: the model's head is its embedding ([Note: tied stages in the plan] in
    fsdpkit.planner.pipeline.tied); ``twin``: the sharded elements of the tied head's copy
    the rank's optimizer does not step (it steps the first stage's): no optimizer
    state, its gradient dropped before the step."""
    led = Ledger()
    steps = {
        s: StageStep(
            sc, stage=s, first=s == 0, last=s == last_stage, local=set(stages), led=led, tied=tied
        )
        for s, sc in stages.items()
    }
    for step in steps.values():
        step.stage_persistent(micro_batches=micro_batches)
    any_sc = next(iter(stages.values()))
    led.add("buffers_inputs", micro_batches * any_sc.micro_batch * (any_sc.seq_len + 1) * 8)
    led.add("optimizer_states", -8 * twin)
    _reference_pass(led, list(stages.values()))
    _replay(steps, actions, led=led, schedule=schedule)
    led.add("gradients", -4 * twin)
    _optimizer(led, list(stages.values()))
    return MemoryPlan(
        mode="analytic",
        peak=led.peak,
        phase_peaks=dict(led.phase_peaks),
        model_states=stages_states(list(stages.values()), twin=twin),
        host_bytes=0,
        spread=max(late_free_spread(sc) for sc in stages.values()),
    )


def _replay(
    steps: dict[int, StageStep], actions: tuple[Action, ...], *, led: Ledger, schedule: str
) -> None:
    """The rank's actions in order, with what they send kept as long as the schedule
    keeps the send ([Note: pipeline sends])."""
    releases = send_releases(schedule, actions, local=set(steps))
    dropped: dict[int, int] = {}  # action index -> bytes whose sends go after it
    for i, (kind, stage, mb) in enumerate(actions):
        step = steps[stage]
        whole = kind == "B" or (kind == "W" and step.first)  # torch: the first stage's W
        if kind == "F":
            step.forward_action()
        elif whole or (kind == "I" and not step.first):
            kept = releases.get(("output", stage, mb), -1)
            keep = kept > i or step.local_next
            if whole:
                step.backward_action(keep_output=keep)
            else:
                step.input_action(mb, keep_output=keep)
            if kept > i and not step.last:
                dropped[kept] = dropped.get(kept, 0) + step.s.nde
            at = releases.get(("grad", stage, mb), i)
            dropped[at] = dropped.get(at, 0) + step.sending
            step.sending = 0
        elif kind == "W":
            step.weight_action(mb)
        elif kind == "R":
            step.reduce_action()
        led.add(TEMP, -dropped.pop(i, 0))
    led.add(TEMP, -sum(dropped.values()))


def _reference_pass(led: Ledger, stages: list[Scenario]) -> None:
    """DPO's separate reference: the rank's stages of it, resident all step, and its
    forward pass through them before the schedule, one stage's gathered units (and the
    last stage's logits) at a time ([Note: reference in the plan])."""
    led.add("reference", sum(sc.reference_bytes for sc in stages))
    forward = max(sc.reference_forward for sc in stages)
    if forward:
        led.at("forward", "reference model forward (no grad)")
        led.add("reference", forward)
        led.add("reference", -forward)


def rank_scenario(stages: list[Scenario]) -> Scenario:
    """A rank's stages as one scenario (its units together): what one optimizer over
    all of them steps, and what the rank's FSDP2 traffic adds up over."""
    first = stages[0]
    return first.with_(
        units=tuple(u for sc in stages for u in sc.units),
        edges=tuple(e for sc in stages for e in sc.edges),
        expert_units=tuple(u for sc in stages for u in sc.expert_units),
        keep_unsharded=True,
        accum_sync="last",
    )


def _optimizer(led: Ledger, stages: list[Scenario]) -> None:
    """AdamW over the rank's parameters, as the replay's optimizer step models it."""
    step = Step(rank_scenario(stages))
    step.led = led
    step.optimizer()
