"""Pipeline parallelism (``parallel.pp``): one axis, one folder.

    split   [Note: stage split]: which blocks each stage holds
    parts   [Note: stage modules]: a stage as the model's own module, other stages'
            parts taken out (the edge modules themselves: fsdpkit.sharding.stage_edges)
    tied    [Note: tied embeddings across stages]
    stages  [Note: a stage's forward]: stages, their FSDP root
    schedule   torch's schedule over a rank's stages
    routing    [Note: the router loss across stages]: a mixture-of-experts model's
               router loss carried with the hidden states

The pipelined step that drives them is ``fsdpkit.trainable.pipeline``.
"""
