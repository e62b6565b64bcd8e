"""The ``[CONFIG.toml] [key=value ...]`` arguments shared by train and plan."""

from __future__ import annotations

import argparse


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
