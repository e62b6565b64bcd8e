#!/usr/bin/env bash
# SLURM for tests/slurm: Debian's slurmctld, slurmd, the client commands (sbatch, srun,
# scontrol, ...) and munge, installed with apt-get when missing. `make test` runs this
# first; tests/slurm/conftest.py skips the SLURM tests, naming why, where these
# commands are still missing (not root, no apt-get, the install failed).
#
# Idempotent: with every command present it does nothing. No daemon is left running:
# the packages' maintainer scripts are told not to start their services (a
# policy-rc.d that answers 101, as in container images), because the tests start
# their own cluster with its own configuration, key and sockets.
set -uo pipefail

need=(slurmctld slurmd sbatch srun scontrol squeue scancel munged mungekey)
missing=()
for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] && exit 0

say() { echo "tests/slurm/install.sh: $*" >&2; }
if [ "$(id -u)" != 0 ]; then
    say "not root, cannot install ${missing[*]}: the SLURM tests will be skipped."
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get, cannot install ${missing[*]}: the SLURM tests will be skipped."
    exit 0
fi

policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
status=0
apt-get update -qq >/dev/null || status=$?
if [ $status -eq 0 ]; then
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge \
        >/dev/null || status=$?
fi
[ $made_policy -eq 1 ] && rm -f "$policy"
if [ $status -ne 0 ]; then
    say "apt-get failed (exit $status): the SLURM tests will be skipped."
fi
exit 0
