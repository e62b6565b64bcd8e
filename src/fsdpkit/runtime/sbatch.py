"""An sbatch script for a training config, and its submission (``fsdpkit slurm``).

The script asks SLURM for ``nodes`` x ``tasks_per_node`` tasks and runs
``srun python -m fsdpkit train ...``: one task per rank, each joining from SLURM's
own variables ([Note: SLURM join] in fsdpkit.runtime.slurm). What happens around
the time limit and preemption is [Note: SLURM stop and requeue].

[Note: SLURM stop and requeue]
- ``--signal=SIG@GRACE``: SLURM signals every task GRACE seconds before the time
  limit (SIGUSR1 by default: it means only "save and stop", unlike SIGTERM, which
  also arrives when a job is cancelled). Every rank saves the step it is on and exits
  128 + SIG (138 for SIGUSR1, 143 for SIGTERM) ([Note: agreeing to stop]).
- ``scancel --signal=TERM`` / ``--signal=USR1`` (a preemption warning): the same.
- With ``requeue``, a step that ended with one of those two codes and left a newer
  complete checkpoint in the run dir than it started with: the script requeues its own
  job (``scontrol requeue $SLURM_JOB_ID``), which starts again later under the same job
  id and resumes from that checkpoint (``checkpoint.resume = auto``, the default). A
  signal before the first step saves nothing, and a requeue would only repeat that (a
  loop, found with ``--time=1 --grace=50``): the script says so and ends instead.
- ``scontrol requeue`` from outside (an admin, a preempting scheduler): slurmd sends
  SIGTERM to every step, and waits KillWait before SIGKILL; the ranks save as above
  and the job comes back by itself. srun forwards the SIGTERM it gets to the same
  tasks, so a task sees it twice ([Note: repeated SLURM signals]).
- The log is opened in append mode: a requeued job adds to it instead of truncating
  what the previous run wrote.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdpkit.errors import UserError
from fsdpkit.runtime.rundir import check_run_dir

SAVED_CODES = {"USR1": 138, "TERM": 143}
"""A step's exit code after the stop signal saved the current step ([Note: SLURM stop
and requeue])."""
MAX_GRACE_S = 65535
"""SLURM stores the signal's lead time in 16 bits."""


@dataclass(frozen=True)
class JobSpec:
    """What ``fsdpkit slurm`` asks of SLURM for one training run."""

    items: tuple[str, ...]
    """``fsdpkit train``'s CONFIG.toml and key=value arguments, as given."""
    nodes: int
    tasks_per_node: int
    run_dir: Path | None = None
    """The run's logging.run_dir: the script and SLURM's log go there (None: SLURM's
    default log, ``slurm-JOBID.out`` in the submitting directory)."""
    time: str | None = None
    """SLURM's time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``); None: the
    partition's default."""
    partition: str | None = None
    requeue: bool = True
    signal: str = "USR1"
    grace_s: int = 120
    job_name: str = "fsdpkit"
    gpus: bool = False
    """One GPU per task (``--gpus-per-node``)."""
    python: str = "python"

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def log(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / "slurm-%j.out"

    def log_of(self, job_id: int) -> Path | None:
        """The log of job ``job_id`` (``%j`` filled in)."""
        return None if self.log is None else Path(str(self.log).replace("%j", str(job_id)))

    def with_run_dir(self, run_dir: Path) -> JobSpec:
        return dataclasses.replace(self, run_dir=run_dir)


def time_seconds(text: str) -> int:
    """SLURM's ``--time`` in seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``. ValueError for anything else."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ValueError(text)
    days, a, b, c = (int(g) if g else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return (a or 0) * 3600 + (b or 0) * 60 + c
    if b is not None:
        return (a or 0) * 60 + b
    return (a or 0) * 60


def check_spec(spec: JobSpec) -> None:
    """Refuse what SLURM would refuse later or run wrongly, one paragraph each."""
    if spec.nodes < 1 or spec.tasks_per_node < 1:
        raise UserError(
            f"--nodes {spec.nodes} --tasks-per-node {spec.tasks_per_node}: both must be >= 1 "
            "(one task per rank: per GPU on GPU nodes)."
        )
    if spec.signal not in SAVED_CODES:
        raise UserError(
            f"--signal {spec.signal}: fsdpkit saves and stops on {' or '.join(SAVED_CODES)}. "
            "Use USR1 (the time-limit warning) or TERM."
        )
    if not 0 < spec.grace_s <= MAX_GRACE_S:
        raise UserError(
            f"--grace {spec.grace_s}: the signal's lead time before the time limit must be "
            f"1-{MAX_GRACE_S} s; give it at least the time of one step plus one checkpoint save."
        )
    if spec.time is None:
        return
    try:
        limit = time_seconds(spec.time)
    except ValueError:
        raise UserError(
            f"--time {spec.time!r} is not a SLURM time: use MM, MM:SS, HH:MM:SS or D-HH:MM:SS."
        ) from None
    if limit <= spec.grace_s:
        raise UserError(
            f"--time {spec.time} ({limit} s) is not longer than --grace {spec.grace_s}: the "
            "stop signal would come before training starts. Raise --time or lower --grace."
        )


def render(spec: JobSpec) -> str:
    """The sbatch script ([Note: SLURM stop and requeue])."""
    command = " ".join(shlex.quote(x) for x in [spec.python, "-m", "fsdpkit", "train", *spec.items])
    gpu = f"#SBATCH --gpus-per-node={spec.tasks_per_node}"
    head = [
        "#!/bin/bash",
        f"# Generated by `fsdpkit slurm`: fsdpkit train on {spec.nodes} node(s) x "
        f"{spec.tasks_per_node} task(s). Submit with: sbatch THIS_FILE",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={spec.tasks_per_node}",
        gpu if spec.gpus else f"#{gpu}   # uncomment on GPU nodes",
        *([f"#SBATCH --time={spec.time}"] if spec.time else []),
        *([f"#SBATCH --partition={spec.partition}"] if spec.partition else []),
        *([f"#SBATCH --output={spec.log}"] if spec.log else []),
        "#SBATCH --open-mode=append",
        f"# {spec.signal} {spec.grace_s} s before the time limit: every rank saves the step.",
        f"#SBATCH --signal={spec.signal}@{spec.grace_s}",
        "#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue",
    ]
    body = [
        "set -u",
        "# SLURM's own SIGTERM (requeue, cancel, time limit) reaches this script too: wait",
        "# for srun, whose tasks are saving, instead of dying at once and losing their output.",
        "terminated=0",
        "trap 'terminated=1' TERM",
        'echo "fsdpkit slurm: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
        '${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-?}}"',
        "# MASTER_ADDR / MASTER_PORT default to the first node and 10000 + job id mod",
        "# 10000; export them here to choose others.",
        *(_newest_line("before", spec.run_dir) if spec.requeue and spec.run_dir else []),
        f"srun --kill-on-bad-exit=1 {command}",
        "code=$?",
        "# A node that failed under the job: name it (srun's own lines may not).",
        'if [ "$code" -ne 0 ]; then',
        '    down=$(sinfo -h -N -n "${SLURM_JOB_NODELIST:-}" -t down,drain,fail,no_respond \\',
        """        -o '%N (%T: %E)' 2>/dev/null | sort -u | paste -sd ',' -)""",
        '    [ -n "$down" ] && echo "fsdpkit slurm: node(s) of this job down: $down"',
        "fi",
    ]
    if spec.requeue and spec.run_dir is not None:
        body += _requeue_lines(spec.run_dir)
    return "\n".join([*head, *body, "exit $code", ""])


def _newest_line(var: str, run_dir: Path) -> list[str]:
    """Shell: ``var`` = the newest complete checkpoint of the run ([Note: completion
    marker]: zero-padded step directories holding fsdpkit.json)."""
    pattern = shlex.quote(str(run_dir / "checkpoints")) + "/step-*[0-9]/fsdpkit.json"
    return [f"{var}=$(ls -d {pattern} 2>/dev/null | sort | tail -n 1)"]


def _requeue_lines(run_dir: Path) -> list[str]:
    """Shell: requeue this job after a stop signal that saved a new checkpoint, unless
    SLURM is ending the job itself ([Note: SLURM stop and requeue]). No new checkpoint
    (the signal came before the first step): requeueing would only repeat that."""
    codes = sorted(SAVED_CODES.values())
    return [
        f"# {' or '.join(map(str, codes))}: a stop signal; with a new checkpoint, come back and",
        "# resume from it (unless SLURM is ending the job: it requeues a requeued job itself).",
        *_newest_line("after", run_dir),
        f'case "$terminated:$code" in {"|".join(f"0:{c}" for c in codes)})',
        '    if [ -n "$after" ] && [ "$after" != "$before" ]; then',
        '        echo "fsdpkit slurm: step saved (exit $code): requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID"',
        "    else",
        '        echo "fsdpkit slurm: stopped (exit $code) with no new checkpoint: not requeueing'
        ' (the signal came before a step finished: raise --time or lower --grace)"',
        "    fi ;;",
        "esac",
    ]


def write_and_submit(spec: JobSpec) -> tuple[Path, int]:
    """Write ``RUN_DIR/job.sbatch`` (the run dir checked and made first: SLURM opens the
    log there before the script runs, and fails the job without a word if it cannot)
    and submit it; the script and the job id."""
    assert spec.run_dir is not None
    check_run_dir(spec.run_dir)
    script = spec.run_dir / "job.sbatch"
    script.write_text(render(spec))
    return script, submit(script)


def submit(script: Path, *, sbatch: str = "sbatch", extra: Sequence[str] = ()) -> int:
    """``sbatch --parsable script``; the job id. UserError when sbatch is missing or
    refuses (its own message quoted)."""
    if shutil.which(sbatch) is None:
        raise UserError(
            f"`{sbatch}` is not on PATH: run `fsdpkit slurm` on a SLURM login node, or use "
            f"--print and submit {script} from one."
        )
    result = subprocess.run(
        [sbatch, "--parsable", *extra, str(script)], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise UserError(
            f"sbatch refused {script}: {result.stderr.strip() or result.stdout.strip()}. Fix the "
            "option it names (fsdpkit slurm --partition / --time / --nodes), or edit the script "
            "and submit it with sbatch."
        )
    return int(result.stdout.strip().split(";")[0])
