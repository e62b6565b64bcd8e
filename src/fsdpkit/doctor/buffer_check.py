"""Buffers that meta-device initialization would leave as garbage.

On the meta device a buffer has a shape but no value; ``to_empty`` gives it whatever
memory held, and only the model's ``init_buffers()`` hook (see ``fsdpkit.init``) can
put the constructor's value back (RoPE tables are the classic case: garbage there
trains silently wrong). Buffers the constructor computed while the parameters went to
meta (``fsdpkit.meta_params``, ``model.hf``) are kept by materialization and pass. For
meta buffers the check replays fsdpkit's buffer path twice, with the
buffers first filled with 0 and then with 1: a buffer whose value after
``init_buffers`` depends on that fill was never initialized. Where a CPU build is
available its buffers are the reference the recreated ones must equal.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdpkit.doctor.check import Check, fail, ok, skip, warn
from fsdpkit.init import init_buffers


def _fill_buffers(model: nn.Module, value: int) -> None:
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.full(buf.shape, value, dtype=buf.dtype)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for prefix, module in model.named_modules():
        for key in module._non_persistent_buffers_set:
            out.add(f"{prefix}.{key}" if prefix else key)
    return out


def recreated_buffers(meta_model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(buffer values after fsdpkit's materialization path, names left uninitialized).

    Consumes ``meta_model``: its buffers are replaced by CPU tensors."""
    runs = []
    for fill in (0, 1):
        _fill_buffers(meta_model, fill)
        init_buffers(meta_model)
        runs.append(_snapshot(meta_model))
    first, second = runs
    garbage = [n for n in first if n not in second or not _same(first[n], second[n])]
    return first, garbage


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return torch.equal(a, b)


def _mismatched(
    values: dict[str, torch.Tensor], reference: nn.Module, skip_: list[str]
) -> list[str]:
    ref = dict(reference.named_buffers())
    out = []
    for name, value in values.items():
        if name in skip_ or name not in ref:
            continue
        expected = ref[name].detach().to("cpu")
        if expected.shape != value.shape or not torch.allclose(
            value.to(expected.dtype), expected, rtol=1e-6, atol=1e-7, equal_nan=True
        ):
            out.append(name)
    return out


def _without_meta_buffers(meta_model: nn.Module, *, name: str) -> Check:
    """The verdict when no buffer is on meta: nothing for materialization to lose."""
    if not any(True for _ in meta_model.buffers()):
        return ok(name, "the model has no buffers")
    if any(p.is_meta for p in meta_model.parameters()):  # fsdpkit.meta_params, model.hf
        return ok(
            name,
            "parameters on meta, buffers computed by the model's constructor: kept "
            "across materialization",
        )
    return skip(name, "the model does not build on the meta device (its factory ignores it)")


def check_meta_buffers(
    meta_model: nn.Module,
    *,
    reference: nn.Module | None,
    as_run_meta: bool,
    loads_persistent: bool,
) -> Check:
    """Verdict on the buffers of a model built on the meta device.

    ``as_run_meta``: the run itself builds on meta (garbage is then a failure, else a
    warning about what meta-device init would do). ``loads_persistent``: persistent
    buffers come from ``model.init_from``. ``reference``: a CPU build, or None."""
    name = "meta buffers"
    if not any(b.is_meta for b in meta_model.buffers()):
        return _without_meta_buffers(meta_model, name=name)
    try:
        values, garbage = recreated_buffers(meta_model)
    except Exception as exc:
        return fail(
            name,
            f"init_buffers() failed on a model materialized from the meta device: "
            f"{type(exc).__name__}: {exc}",
            "make init_buffers() recompute buffers from the module's own config only",
        )
    non_persistent = _non_persistent(meta_model)
    if loads_persistent:
        garbage = [g for g in garbage if g in non_persistent]
    wrong = _mismatched(values, reference, garbage) if reference is not None else []
    status = fail if as_run_meta else warn
    when = "this run builds on the meta device" if as_run_meta else "if built on the meta device"
    if garbage:
        kinds = ", ".join(
            f"{g} ({'non-persistent' if g in non_persistent else 'persistent'})"
            for g in garbage[:6]
        )
        return status(
            name,
            f"{when}, {len(garbage)} buffer(s) keep whatever memory held: {kinds}. Nothing "
            "re-creates them (no init_buffers() hook, and non-persistent buffers are in no "
            "checkpoint): training would silently use garbage",
            "define init_buffers(self) on the model to recompute them (fsdpkit calls it after "
            "materializing), or build the model on the CPU (model.meta_init = false)",
        )
    if wrong:
        return status(
            name,
            f"{when}, init_buffers() recreates {', '.join(wrong[:6])} with values that differ "
            "from the constructor's",
            "make init_buffers() compute exactly what __init__ computes",
        )
    checked = "equal to a CPU build" if reference is not None else "deterministic"
    return ok(
        name, f"{len(values)} buffer(s) re-created by init_buffers() after meta init ({checked})"
    )
