"""Hugging Face models (``model.hf``): read, built on meta, initialized on shards.

directory   a model.hf directory read and checked; its files copied into the run
construct   the model built from its config on meta, and its weights (``HFWeights``)
initialize  HF init on shards: the model's own ``_init_weights`` per parameter slice
"""
