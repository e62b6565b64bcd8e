"""Tensor parallelism (``parallel.tp``): one axis, one folder.

    rules     which tp layout a model takes: block plans, sequence parallelism, the
              vocabulary split; no DTensor, so checks and the planner stay light
    plans     [Note: tensor-parallel plans], applied with ``parallelize_module``
    edges     the embedding and head split by vocabulary, where the sequence is split
    sequence  norms and gathered inputs of sequence-parallel blocks
    moe       [Note: experts under tensor parallelism]: mixture-of-experts blocks

``fsdpkit.sharding.apply`` calls ``plans.tensor_parallel`` first in its fixed order.
"""
