"""What a run trains, built once for the trainer and the planner alike.

Modules:
    build   ``build_trainable``: the model (meta or real, on a real or fake process
            group), prepared for fine-tuning, sharded, its loss and its optimizer
    optim   the AdamW kernels and the learning-rate schedule
    step    one optimizer step: the function ``fsdpkit train`` runs and the planner traces
"""
