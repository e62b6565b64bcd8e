"""Write a small Hugging Face model directory locally (random weights, nothing downloaded).

    python examples/make_tiny_hf_model.py tiny-llama                     # Llama, with weights
    python examples/make_tiny_hf_model.py tiny-gpt2 --arch gpt2 --dim 128 --layers 4
    python examples/make_tiny_hf_model.py tiny-cfg --config-only         # config.json only
    python examples/make_tiny_hf_model.py tiny-chat --chat   # + a ChatML chat template (SFT)
    fsdpkit train model.hf=tiny-llama train.steps=50

The directory gets config.json, generation_config.json, model.safetensors (the model's
own random init, seeded) and a byte-level BPE tokenizer.json trained in a second on the
Python standard library's sources, so `fsdpkit train model.hf=DIR` works offline.
"""

from __future__ import annotations

import argparse

from tiny_hf import ARCHS, write_tiny_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--vocab", type=int, default=320, help="vocabulary (and tokenizer) size")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--ffn", type=int, default=128, help="MLP hidden size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--config-only", action="store_true", help="no weights: random init at train time"
    )
    p.add_argument("--no-tokenizer", action="store_true", help="no tokenizer files")
    p.add_argument(
        "--chat", action="store_true", help="tokenizer with a ChatML chat template (chat SFT data)"
    )
    args = p.parse_args()
    out = write_tiny_model(
        args.out,
        arch=args.arch,
        seed=args.seed,
        weights=not args.config_only,
        tokenizer=not args.no_tokenizer,
        chat=args.chat,
        vocab_size=args.vocab,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
    )
    print(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))


if __name__ == "__main__":
    main()
