"""Stop requests become a flag the loop polls (fsdpkit.runtime.signals): SIGTERM sets it;
the first of SIGTERM / SIGINT / SIGHUP is recorded, a second exits at once (that one
in a subprocess: it ends the process it runs in)."""

from __future__ import annotations

import os
import signal

from fsdpkit.runtime.signals import install_sigterm_flag
from support import run_python


def test_sigterm_sets_the_flag() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        flag = install_sigterm_flag()
        assert flag() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag() is True
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_flag_records_the_first_signal_and_a_second_exits_at_once() -> None:
    result = run_python(
        """
        import os, signal
        from fsdpkit.runtime.signals import install_stop_flag, agreed_signal
        flag = install_stop_flag()
        os.kill(os.getpid(), signal.SIGHUP)
        print(flag.name, agreed_signal(flag.signum), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached")
        """
    )
    assert result.stdout.split() == ["SIGHUP", "1"] and result.returncode == 128 + 2, result
