"""Write a toy verifiable task for GRPO: copy a short word (nothing is downloaded).

    python examples/make_rl_prompts.py rl-copy          # rl-copy/sft.jsonl, rl-copy/prompts.jsonl
    fsdpkit train examples/rl_copy_sft.toml             # SFT: teaches the answer's format
    fsdpkit ckpt export runs/rl-copy-sft/checkpoints/step-00000030 --format hf rl-copy-sft
    fsdpkit train examples/rl_copy_grpo.toml            # GRPO from the SFT weights

The prompt is a word of ``--length`` letters from the first ``--letters`` of the
alphabet and ``=`` (``"bdj="``); the answer is the word itself, and a completion is
right when it is the word followed by a newline (the ``exact`` reward, the run's stop
string ``"\\n"``). ``prompts.jsonl`` holds ``--words`` distinct words as GRPO prompt
rows (``{"prompt", "answer"}``); its last ``--held-out`` share is what
``data.val_fraction`` holds out, and ``sft.jsonl`` holds the other words only, as SFT
rows (``{"prompt", "completion"}``), so the held-out words are never trained on. A short
SFT run teaches the format (letters, then a newline) and copies some words right;
GRPO, rewarded only for exact copies, raises the held-out share (bench/rl_learns.py
measures it; docs/rl.md has the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path


def words(*, count: int, letters: int, length: int, seed: int) -> list[str]:
    """``count`` distinct words in a seeded order."""
    alphabet = string.ascii_lowercase[:letters]
    if count > letters**length:
        raise SystemExit(f"--words {count}: only {letters**length} words of that shape exist")
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen["".join(rng.choice(alphabet) for _ in range(length))] = None
    return list(seen)


def write(out: Path, *, count: int, letters: int, length: int, held_out: float, seed: int) -> None:
    """``out/prompts.jsonl`` (every word) and ``out/sft.jsonl`` (the words GRPO trains on)."""
    out.mkdir(parents=True, exist_ok=True)
    chosen = words(count=count, letters=letters, length=length, seed=seed)
    n_val = int(len(chosen) * held_out)  # as data.val_fraction counts (fsdpkit.data.prompts)
    prompts = [{"prompt": f"{w}=", "answer": w} for w in chosen]
    sft = [{"prompt": f"{w}=", "completion": f"{w}\n"} for w in chosen[: len(chosen) - n_val]]
    for name, rows in (("prompts.jsonl", prompts), ("sft.jsonl", sft)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out / 'prompts.jsonl'} ({len(prompts)} prompts, the last {n_val} held out)")
    print(f"wrote {out / 'sft.jsonl'} ({len(sft)} SFT rows, held-out words left out)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write (created)")
    p.add_argument("--words", type=int, default=400, help="distinct words (prompts)")
    p.add_argument("--letters", type=int, default=10, help="alphabet size")
    p.add_argument("--length", type=int, default=3, help="letters per word")
    p.add_argument("--held-out", type=float, default=0.2, help="= data.val_fraction")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write(
        a.out, count=a.words, letters=a.letters, length=a.length, held_out=a.held_out, seed=a.seed
    )


if __name__ == "__main__":
    main()
