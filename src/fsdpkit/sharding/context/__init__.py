"""Context parallelism (``parallel.cp``): one axis, one folder.

    attention  [Note: Ulysses context parallelism]: the all-to-all exchange around the
               attention core, applied to built-in and transformers models
    ring       [Note: ring attention]: torch's ring SDPA and its CPU kernel adapter
    batch      the cp split of a batch, [Note: context-parallel loss normalization]

Head-count rules both cp and tp read live below both, in ``fsdpkit.sharding.heads``.
"""
