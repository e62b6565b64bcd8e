"""The ``[CONFIG.toml] [key=value ...]`` arguments shared by train and plan."""

from __future__ import annotations

import argparse

from fsdpkit import config as configuration


def add_config_items(parser: argparse.ArgumentParser, *, example: str) -> None:
    parser.add_argument(
        "items",
        nargs="*",
        metavar="CONFIG.toml | key=value",
        help=f"optional TOML config file, then dotted overrides ({example})",
    )


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """(config path or None, overrides): the first item is a file unless it has '='."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def tokenizer_vocab(cfg: configuration.RunConfig) -> int | None:
    """The tokenizer's vocabulary as train takes it (None: the preset's own)."""
    if cfg.model.vocab_size is not None or cfg.data.tokenizer is None:
        return None
    from fsdpkit.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.data).vocab_size
