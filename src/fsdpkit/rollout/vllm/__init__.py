"""rl.engine = vllm: a vLLM engine process beside each data-parallel rank, its weights
pushed from the policy's shards after every update, its samples checked by the
log-prob gap like the embedded engine's (docs/rl-vllm.md).

Modules:
    engine   the engine the GRPO step samples from ([Note: the vLLM engine])
    start    a run's engine: model directory, dtype, KV cache, log
    sync     the push: shards -> whole tensors in the checkpoint layout, LoRA folded
             in ([Note: pushing weights to the engine])
    process  the trainer's side of the engine process: start, call, stop, failures
    server   the engine process itself, in the environment that has vLLM ([Note: the
             vLLM engine process])
    wire     messages and shared-memory weight buckets ([Note: the engine wire])
"""
