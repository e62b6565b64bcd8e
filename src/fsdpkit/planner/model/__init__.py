"""What a model holds, as the planner sees it (the lowest floor of the planner).

layout           the units ``shard()`` builds, read off the model on meta
user_models      [Note: planning any model]: model.hf directories and factories
builtin          the built-in presets' shapes, layouts and block models
finetune_layout  frozen parameters, LoRA adapters and the base's dtype
reference        [Note: reference in the plan]: DPO's (and GRPO's KL) frozen reference
grpo_terms       [Note: the GRPO step in the plan]: a GRPO run's numbers and phases
"""
