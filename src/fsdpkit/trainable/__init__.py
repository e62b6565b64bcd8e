"""What a run trains, built once for the trainer and the planner alike.

Modules:
    build   ``build_trainable``: the model (meta or real, on a real or fake process
            group), prepared for fine-tuning, sharded, its loss and its optimizer
    optim   the AdamW kernels and the learning-rate schedule
    step    one optimizer step: the function ``fsdpkit train`` runs and the planner traces
    pipeline_build  ``build``'s step 2 under ``parallel.pp``: the rank's stages
    pipeline_step   a pipelined optimizer step and evaluation
"""
