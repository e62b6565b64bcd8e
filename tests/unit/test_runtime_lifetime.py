"""Workers never outlive their parent (fsdpkit.runtime.lifetime), in subprocesses."""

from __future__ import annotations

from support import run_python


def test_a_worker_dies_with_its_parent_even_without_prctl() -> None:
    """The watchdog alone (prctl disabled): kill -9 the parent, the child follows."""
    result = run_python(
        """
        import os, subprocess, sys, time
        child = '''
        import os, sys, time
        from fsdpkit.runtime import lifetime
        lifetime.set_parent_death_signal = lambda sig=9: False   # the fallback only
        lifetime.bind_to_parent(int(sys.argv[1]), interval=0.1)
        print(os.getpid(), flush=True)
        time.sleep(60)
        '''
        parent = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, os; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
            "str(os.getpid())]); import time; time.sleep(60)", child], stdout=subprocess.PIPE,
            text=True)
        pid = int(parent.stdout.readline())
        os.kill(parent.pid, 9)
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:  # gone, or a zombie waiting for init to reap it
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "Z"
            if state == "Z":
                print("gone", flush=True)
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
        """,
        timeout=90,
    )
    assert result.stdout.strip() == "gone", result
