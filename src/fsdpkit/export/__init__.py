"""Checkpoints to files others load: HF safetensors (fsdpkit's Llama and ``model.hf``
runs), peft adapter directories, merged LoRA weights, one torch file. Offline, one
process; reads DCP checkpoints through fsdpkit.checkpoint's verifying reader.

Modules:
    offline   ``export``: a checkpoint's weights as HF safetensors or one torch file
    hf_files  the LlamaConfig of a checkpoint, HF config.json, the model.hf files to ship
    adapters  LoRA: a peft adapter directory, or merged weights
"""

from fsdpkit.export.hf_files import hf_config, llama_config
from fsdpkit.export.offline import export

__all__ = ["export", "hf_config", "llama_config"]
