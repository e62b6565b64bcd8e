"""The cyclic collector is paused while DCP saves or loads, and restored as it was
([Note: no cyclic GC inside a checkpoint])."""

from __future__ import annotations

import gc
import threading

import pytest

from fsdpkit.checkpoint.gcpause import gc_paused


def test_the_collector_is_off_inside_and_back_on_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_re_enable_only_when_the_last_ends() -> None:
    """An async save's background write beside a resume on the main thread."""
    inside, release = threading.Event(), threading.Event()

    def background() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=background)
    t.start()
    inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the background pause still runs
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off_and_errors_restore_it() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("save failed")
    assert gc.isenabled()
