"""Final-answer equivalence for the built-in ``math`` reward.

[Note: math answers]
The answer of a completion is extracted first, the same way for both comparisons: the
last ``\\boxed{...}`` (or ``\\fbox{...}``, braces balanced), else what follows the last
``####`` on its line (GSM8K's style), else the last number in the text; no candidate
scores 0. The reference comes from the row's ``answer`` / ``ground_truth`` / ``solution``
column (the first one present): a number as it is; a text's ``\\boxed{...}`` or
``####`` answer when it has one (GSM8K answers, MATH solutions), else the whole text
stripped; a list of references matches when any one does.

Equivalence: with the ``math-verify`` package installed (``pip install
'fsdpkit[math]'``), both are parsed as ``\\boxed{answer}`` and compared by its ``verify``
(symbolic: ``\\frac{1}{2}`` = ``0.5``, ``x+1`` = ``1+x``, ``\\sqrt{2}`` = ``2^{1/2}``).
Without it, or when math-verify cannot parse the reference, the fallback compares exact
rationals where both sides are numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}`` /
``\\dfrac`` / ``\\tfrac``, signs, thousands separators ``1,000``, a trailing period,
``$`` and ``\\$`` signs) and otherwise the texts with spaces, ``\\left`` / ``\\right`` and
LaTeX spacing commands removed. The run's first lines say which one a run uses.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
"""Whether the math-verify package can be imported here."""

_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
"""A number in running text: a minus sign only where no word or number precedes it
(``5-3`` holds 5 and 3), thousands separators, decimals, ``a/b``."""
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SPACING = re.compile(r"\\left|\\right|\\[,;:! ]|\s+")


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced), or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _after_hashes(text: str) -> str | None:
    at = text.rfind("####")
    if at < 0:
        return None
    line = text[at + 4 :].strip().splitlines()
    return line[0].strip().rstrip(".").strip() if line else None


def extract_answer(text: str) -> str | None:
    """A completion's final answer ([Note: math answers]), or None."""
    found = boxed(text)
    if found is None:
        found = _after_hashes(text)
    if found is None:
        numbers = _NUMBER.findall(text)
        found = numbers[-1] if numbers else None
    return found or None


def references(value: Any) -> list[str]:
    """The reference answers of a column value ([Note: math answers])."""
    if isinstance(value, list | tuple):
        return [r for v in value for r in references(v)]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [str(value)]
    text = str(value)
    found = boxed(text)
    if found is None:
        found = _after_hashes(text)
    return [found if found is not None else text.strip()]


def _clean(text: str) -> str:
    text = _SPACING.sub("", text.strip().strip("$")).replace("\\$", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def as_number(text: str) -> Fraction | None:
    """An exact rational for integers, decimals, ``a/b`` and ``\\frac{a}{b}``, or None."""
    text = _clean(text)
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    frac = _FRAC.match(text)
    if frac:
        top, bottom = as_number(frac.group(2)), as_number(frac.group(3))
        if top is None or not bottom:
            return None
        return -top / bottom if frac.group(1) == "-" else top / bottom
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def fallback_equal(predicted: str, reference: str) -> bool:
    """The comparison without math-verify ([Note: math answers])."""
    a, b = as_number(predicted), as_number(reference)
    if a is not None and b is not None:
        return a == b
    return _clean(predicted) == _clean(reference)


def _verify_equal(predicted: str, reference: str) -> bool:
    """math-verify's equivalence; the fallback when it cannot parse the reference."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeout = {"parsing_timeout": 5 if main else None}  # its timeouts use signal.alarm
    gold = parse(f"\\boxed{{{reference}}}", **timeout)
    if not gold:
        return fallback_equal(predicted, reference)
    guess = parse(f"\\boxed{{{predicted}}}", **timeout)
    return bool(verify(gold, guess, timeout_seconds=5 if main else None))


def answer_matches(completion: str, reference: Any, *, backend: str) -> bool:
    """Whether a completion's final answer equals one of the references of a column
    value; ``backend``: "math-verify" or "fallback"."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    equal = _verify_equal if backend == "math-verify" else fallback_equal
    return any(equal(predicted, ref) for ref in references(reference))


def math_backend() -> str:
    """math-verify where it is installed, else the fallback."""
    return "math-verify" if MATH_VERIFY else "fallback"


def backends() -> Sequence[str]:
    """The backends this machine can run (the fallback always)."""
    return ("fallback", "math-verify") if MATH_VERIFY else ("fallback",)
