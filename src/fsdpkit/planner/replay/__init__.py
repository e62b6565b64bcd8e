"""The analytic replay of one FSDP2 step over a scenario's units.

analytic       ``analytic_plan``: the entry of the replay
step           ``Step``: the step walked unit by unit into a ledger
fsdpunits      FSDP2's per-unit all-gathers, copies, reshards, reduce-scatters
gradlife       how long FSDP2 and autograd keep a unit's gradients
ledger         live bytes per category and their peak
blocksizes     the byte sizes a block's event model runs over
blockmem       [Note: block event model]: tensor lifetimes inside one block
blockexchange  tp / sp / Ulysses exchanges inside a block, as events
ringmem        [Note: ring attention memory]
headmem        the loss head's tensor lifetimes
grpohead       [Note: GRPO loss head memory]: GRPO's loss head instead of cross-entropy
rolloutmem     [Note: rollout memory]: a GRPO step's rollout phase, pure over numbers
sizing         one rank's sizes of a block's and the head's tensors
comm           bytes each rank sends per optimizer step
"""
