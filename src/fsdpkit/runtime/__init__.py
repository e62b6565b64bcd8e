"""The process machinery of a run: starting ranks and ending them, whatever happens.

Modules, one job each:
    launch      start ranks with torch's elastic runtime (spawn, torchrun, SLURM joins);
                report how they ended
    rendezvous  stores that listen only where they must, fail fast on a busy port
    lifetime    workers never outlive their launcher
    sidecar     helper processes a rank starts (the vLLM engine): die with the rank,
                never see its distributed variables
    interrupts  the launcher's side of Ctrl-C, SIGHUP, SIGTERM, SIGQUIT
    signals     the worker's side: stop requests as a flag the loop polls, agreed by all ranks
    failures    why a run failed, said once (the first failing rank)
    capacity    does this machine have room for the workers asked for
    rundir      the run directory as a place to write (file-system faults as user errors)
    runlock     one run per run directory
    slurm       SLURM task environments and batch scripts
    hangs/      hang triage: progress records, flight recorder, reports

Only this package (and the CLI) reads the launcher's environment variables.
"""
