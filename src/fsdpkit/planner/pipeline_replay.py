"""One pipeline rank's step replayed into a ledger: its stages' FSDP2 units as torch's
schedule drives them, action by action ([Note: pipeline plans] in
fsdpkit.planner.pipeline).

[Note: what a pipeline stage holds]
Besides what a stage's blocks, embedding, head and loss hold as in any step
(fsdpkit.planner.replay), measured on torch 2.13's PipelineStage with an FSDP2 stage
module ([Note: FSDP inside a stage] in fsdpkit.sharding.pipeline):

- FSDP2 inside the stage: every backward but the stage's last runs without gradient
  reduction and without resharding, so after a stage's first backward its units'
  unsharded parameters stay until the next forward reshards them, and their unsharded
  gradients accumulate until the stage's REDUCE_GRAD reduce-scatters them all (the
  replay's ``last`` accumulation with parameters kept unsharded);
- a stage that receives hidden states keeps one receive buffer per micro-batch for
  the whole run (torch allocates them at the first step); a stage that sends hidden
  states keeps one gradient receive buffer per micro-batch, and its output in the
  schedule's cache from its forward to its backward;
- what a stage sends lives until the schedule drops the send (``send_lifetime``;
  torch drops the receive buffer's ``.grad`` at once): 1F1B keeps a backward's input
  gradient until its next backward is done, GPipe keeps them all until its last
  backward, and the looped and V schedules (torch's schedule runtime) keep every send,
  the stage outputs included, until the step's actions end (with the input gradients
  kept to the end of the step, pp4's last stage read +5.4% at 16 micro-batches; with
  1F1B's dropped after one action, its middle stages -2%);
- every rank holds the step's micro-batches of token ids (each stage reads them).

The backward of a stage that is not the last starts from the received gradient, which
the block model carries as the hidden-state gradient of the chain; the first block's
backward frees its saved input, which here is the persistent receive buffer (added
back). I and W (zero-bubble schedules) are replayed as a whole backward at I.
"""

from __future__ import annotations

from fsdpkit.planner.analytic import late_free_spread
from fsdpkit.planner.blockmem import ACT, TEMP
from fsdpkit.planner.ledger import Ledger
from fsdpkit.planner.replay import COLL, Step
from fsdpkit.planner.result import MemoryPlan
from fsdpkit.planner.scenario import Scenario
from fsdpkit.planner.states import model_states

Action = tuple[str, int, int]


class StageStep(Step):
    """One stage's units in a rank's shared ledger."""

    def __init__(self, sc: Scenario, *, stage: int, first: bool, last: bool, led: Ledger) -> None:
        super().__init__(sc.with_(keep_unsharded=True, accum_sync="last", grad_accum=2))
        self.led = led
        self.stage, self.first, self.last = stage, first, last
        self.last_micro = False
        self.sending = 0
        """Bytes of the input gradient its last backward handed to an asynchronous send."""

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
        led.add(COLL, -self.fwd_flat)  # the stage root's post-forward
        self.fwd_flat = 0
        self.reshard_after_forward(self.root, self.reshard_of(self.root))

    def backward_action(self, *, keep_output: bool) -> None:
        """``keep_output``: the schedule's send of the stage's output outlives the
        backward (``send_lifetime``), so the output is not freed here."""
        led = self.led
        if self.last:
            self.loss_and_head_backward(sync=False)
        else:
            led.at("backward", f"stage {self.stage} backward (received gradient)")
            led.add(TEMP, self.s.nde)
        for j in reversed(range(self.dead, len(self.units))):
            self.unit_backward(j, sync=False)
        if self.first:
            self.embedding_and_root_backward(sync=False)
        else:
            self._input_gradient()
        if not self.last and keep_output:
            self.sending += self.s.nde
        elif not self.last:
            led.add(ACT, -self.s.nde)  # the stage's output leaves the schedule's cache

    def _input_gradient(self) -> None:
        """The stage root's post-backward; the chain's gradient stays as the receive
        buffer's ``.grad``; the buffer itself, freed by the model as the first block's
        saved input, persists."""
        led = self.led
        led.at("backward", f"stage {self.stage} input gradient")
        self.post_backward(self.root, sync=False)
        for flat in self.prefetched.values():
            led.add(COLL, -flat)
        self.prefetched.clear()
        led.add(COLL, -self.rs_state)
        self.rs_state = 0
        led.add(ACT, self.s.nde)
        self.sending += self.s.nde
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


def send_lifetime(schedule: str) -> str:
    """Until when ``schedule`` keeps what it sends ([Note: what a pipeline stage holds]):
    "next backward" (1F1B), "backwards" (GPipe: its last backward) or "step" (torch's
    schedule runtime: every looped and V schedule)."""
    if schedule == "1F1B":
        return "next backward"
    return "backwards" if schedule == "GPipe" else "step"


def rank_memory(
    stages: dict[int, Scenario],
    actions: tuple[Action, ...],
    *,
    last_stage: int,
    micro_batches: int,
    schedule: str,
) -> MemoryPlan:
    """One pipeline rank's steady-state step ([Note: what a pipeline stage holds]):
    ``stages`` are its stages' scenarios by stage index, ``actions`` its schedule's."""
    led = Ledger()
    steps = {
        s: StageStep(sc, stage=s, first=s == 0, last=s == last_stage, led=led)
        for s, sc in stages.items()
    }
    for step in steps.values():
        step.stage_persistent(micro_batches=micro_batches)
    any_sc = next(iter(stages.values()))
    led.add("buffers_inputs", micro_batches * any_sc.micro_batch * (any_sc.seq_len + 1) * 8)
    _replay(steps, actions, led=led, lifetime=send_lifetime(schedule))
    _optimizer(led, list(stages.values()))
    states: dict[str, int] = {}
    for sc in stages.values():
        for key, value in model_states(sc).items():
            states[key] = states.get(key, 0) + value
    return MemoryPlan(
        mode="analytic",
        peak=led.peak,
        phase_peaks=dict(led.phase_peaks),
        model_states=states,
        host_bytes=0,
        spread=max(late_free_spread(sc) for sc in stages.values()),
    )


def _replay(
    steps: dict[int, StageStep], actions: tuple[Action, ...], *, led: Ledger, lifetime: str
) -> None:
    """The rank's actions in order, with what they send kept for ``lifetime``."""
    backwards = [i for i, a in enumerate(actions) if a[0] in ("B", "I")]
    held = 0  # bytes of sends not dropped yet
    for i, (kind, stage, _) in enumerate(actions):
        if kind == "F":
            steps[stage].forward_action()
        elif kind in ("B", "I"):
            steps[stage].backward_action(keep_output=lifetime == "step")
            if lifetime == "next backward":
                led.add(TEMP, -held)
                held = 0
        elif kind == "R":
            steps[stage].reduce_action()
        held += sum(step.sending for step in steps.values())
        for step in steps.values():
            step.sending = 0
        if lifetime == "backwards" and backwards and i == backwards[-1]:
            led.add(TEMP, -held)
            held = 0
    led.add(TEMP, -held)


def rank_scenario(stages: list[Scenario]) -> Scenario:
    """A rank's stages as one scenario (its units together): what one optimizer over
    all of them steps, and what the rank's FSDP2 traffic adds up over."""
    first = stages[0]
    return first.with_(
        units=tuple(u for sc in stages for u in sc.units),
        edges=tuple(e for sc in stages for e in sc.edges),
        keep_unsharded=True,
        accum_sync="last",
    )


def _optimizer(led: Ledger, stages: list[Scenario]) -> None:
    """AdamW over the rank's parameters, as the replay's optimizer step models it."""
    step = Step(rank_scenario(stages))
    step.led = led
    step.optimizer()
