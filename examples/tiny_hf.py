"""Small Hugging Face model directories written locally: make_tiny_hf_model.py's own
module (beside it, so the README's quick start runs from an installed wheel), which
fsdpkit's tests and benchmarks import too (they put examples/ on sys.path). Not part
of the fsdpkit package: the wheel carries only what users call.

Nothing is downloaded: the config comes from a few numbers, the weights from the
model's own random init (seeded), and the tokenizer is a byte-level BPE trained in a
second on the Python standard library's sources (the built-in corpus).

    write_tiny_model("tiny-llama", arch="llama")     # config.json, model.safetensors,
                                                     # generation_config.json, tokenizer.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fsdpkit.data.corpus import stdlib_files

ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "gemma3",
    "exaone4",
    "granite",
    "cohere",
    "olmo",
    "starcoder2",
    "nemotron",
    "gpt_neox",
    "phi",
    "cohere2",
    "hrm_text",
    "gpt2",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "qwen2_moe",
)
"""Architectures ``tiny_config`` knows (all decoder LMs in transformers)."""

MOE_ARCHS = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
"""The mixture-of-experts families among ``ARCHS``."""


def moe_shape(*, experts: int, top_k: int, ffn: int) -> dict[str, Any]:
    """The config keys that size a transformers MoE family's experts (each family
    reads the ones it knows and keeps the rest as plain attributes)."""
    return dict(
        num_local_experts=experts,  # Mixtral
        num_experts=experts,  # Qwen2/3-MoE, OLMoE
        num_experts_per_tok=top_k,
        moe_intermediate_size=ffn,
        shared_expert_intermediate_size=ffn,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


EOS = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""ChatML's turn markers, special tokens of a ``chat=True`` tokenizer."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (Qwen's format): what ``chat=True`` puts in tokenizer_config.json."""


def tiny_config(
    arch: str,
    *,
    vocab_size: int = 320,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    max_positions: int = 512,
    experts: int = 4,
    top_k: int = 2,
) -> Any:
    """A small ``PretrainedConfig`` of ``arch`` (GPT-2: tied embeddings and Conv1D;
    Gemma: tied, zero-centred norms, scaled embeddings; Gemma2 / Gemma3: four norms per
    block; Qwen3, Gemma3, Exaone4: per-head q / k norms; Exaone4: post-norms only;
    Gemma3: ``Gemma3TextConfig``, the text model; Granite: embedding, residual, attention
    and logit multipliers; Cohere: one norm before parallel attention and MLP, tied,
    scaled logits; OLMo: parameter-free norms; Starcoder2: biased linears, GELU MLP
    without a gate; Nemotron: LayerNorm1P, squared-ReLU MLP without a gate; GPT-NeoX:
    fused per-head qkv, parallel residual; Phi: a dropout module in its block; Cohere2:
    sliding-window layers (window 8); HRM text: two stacks of blocks run in cycles, a
    gate on the attention output; Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE: ``experts``
    routed experts, ``top_k`` per token, every layer sparse, saved by transformers in
    their per-expert layout; Qwen2-MoE adds a gated shared expert)."""
    import transformers as T

    special: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
    if arch == "gpt2":
        return T.GPT2Config(
            vocab_size=vocab_size,
            n_embd=dim,
            n_layer=layers,
            n_head=heads,
            n_positions=max_positions,
            resid_pdrop=0.0,  # no dropout: sharded and unsharded runs draw different masks
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        **special,
    )
    classes = {  # names: a family older transformers lack fails only when asked for
        "llama": "LlamaConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "mistral": "MistralConfig",
        "gemma": "GemmaConfig",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "exaone4": "Exaone4Config",
        "granite": "GraniteConfig",
        "cohere": "CohereConfig",
        "olmo": "OlmoConfig",
        "starcoder2": "Starcoder2Config",
        "nemotron": "NemotronConfig",
        "gpt_neox": "GPTNeoXConfig",
        "phi": "PhiConfig",
        "cohere2": "Cohere2Config",
        "hrm_text": "HrmTextConfig",
        "mixtral": "MixtralConfig",
        "qwen3_moe": "Qwen3MoeConfig",
        "olmoe": "OlmoeConfig",
        "qwen2_moe": "Qwen2MoeConfig",
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if arch.startswith(("qwen3", "gemma", "hrm_text")):
        common["head_dim"] = dim // heads
    if arch == "granite":  # off their 1.0 defaults, so a layout that drops one shows
        common |= dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=4.0,
        )
    if arch == "cohere2":  # under a short sequence, so its sliding layers mask something
        common["sliding_window"] = 8
    if arch in MOE_ARCHS:
        common |= moe_shape(experts=experts, top_k=top_k, ffn=ffn)
    config_class = getattr(T, classes[arch], None)
    if config_class is None:
        raise ValueError(
            f"arch {arch!r} needs transformers' {classes[arch]}, which transformers "
            f"{T.__version__} does not have; upgrade transformers or choose another arch"
        )
    return config_class(**common)


def tiny_tokenizer(*, vocab_size: int, max_bytes: int = 400_000, chat: bool = False) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` tokens (id 0 is
    ``EOS``; with ``chat`` ids 1 and 2 are ChatML's markers), trained on the first
    ``max_bytes`` of the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts() -> Any:
        seen = 0
        for file in stdlib_files():
            text = file.read_text(encoding="utf-8", errors="replace")
            seen += len(text)
            yield text
            if seen >= max_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *(CHAT_TOKENS if chat else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def write_tokenizer(out: Path, *, vocab_size: int, chat: bool = False) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (loadable by AutoTokenizer too);
    ``chat``: ChatML markers as special tokens and a ChatML ``chat_template``."""
    import json

    tiny_tokenizer(vocab_size=vocab_size, chat=chat).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tiny_model(
    out: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    weights: bool = True,
    tokenizer: bool = True,
    chat: bool = False,
    **shape: Any,
) -> Path:
    """Write a small model directory: config.json (+ model.safetensors from the model's
    own random init with ``seed``, + tokenizer files, with a ChatML template when
    ``chat``). ``shape``: ``tiny_config`` args."""
    import transformers as T

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **shape)
    if weights:
        torch.manual_seed(seed)
        model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(str(out))
    else:
        config.save_pretrained(str(out))
    if tokenizer:
        write_tokenizer(out, vocab_size=config.vocab_size, chat=chat)
    return out


SHRINK = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
)
"""Size keys ``shrunk_config`` sets where a family's config has them."""


def shrunk_config(model_type: str) -> Any:
    """transformers' default config of ``model_type`` with every size key it has from
    ``SHRINK`` (a few-layer, 32-wide model), no dropout: for tests that enumerate
    families. Some families' defaults do not survive shrinking; callers skip those by
    name when transformers itself cannot build, save and reload them."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    present = config.to_dict()
    for key, value in SHRINK.items():
        if key in present:
            setattr(config, key, value)
    for key, value in present.items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    if "kv_lora_rank" in present:  # multi-head latent attention: one kv head per head
        config.num_key_value_heads = config.num_attention_heads
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(present.get(key), int) and present[key] >= SHRINK["vocab_size"]:
            setattr(config, key, None if key == "pad_token_id" else 0)
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(present.get(key), list):
            setattr(config, key, present[key][: config.num_hidden_layers])
    return config
