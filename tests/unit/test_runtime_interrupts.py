"""The launcher's side of Ctrl-C (fsdpkit.runtime.interrupts), in a subprocess: the first
raises the elastic agent's SignalException (which forwards it to the workers), the
second kills the workers at once."""

from __future__ import annotations

from support import run_python


def test_launcher_signals_forward_once_then_kill_the_workers() -> None:
    result = run_python(
        """
        import os, signal, subprocess, sys, time
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from fsdpkit.runtime.interrupts import ImmediateStop, LauncherSignals
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  start_new_session=True)
        with LauncherSignals():
            try:
                os.kill(os.getpid(), signal.SIGINT); time.sleep(5)
            except SignalException as e:
                print("forward", e.sigval.name, flush=True)
            try:
                os.kill(os.getpid(), signal.SIGINT); time.sleep(5)
            except ImmediateStop as e:
                print("immediate", worker.wait(timeout=5), flush=True)
        """
    )
    assert result.stdout.split() == ["forward", "SIGINT", "immediate", "-9"], result
