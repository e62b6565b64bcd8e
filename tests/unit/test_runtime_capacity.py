"""What one machine can run (fsdpkit.runtime.capacity): workers per core, memory per worker."""

from __future__ import annotations

import pytest

from fsdpkit.runtime.capacity import MIB, Capacity, CapacityError


def test_capacity_warns_about_cores_and_refuses_what_memory_cannot_hold() -> None:
    ok = Capacity(nproc=2, slots=2, device="cpu", per_worker=300 * MIB, available=2**33)
    assert ok.warning() is None
    ok.check_memory()
    over = Capacity(nproc=64, slots=2, device="cpu", per_worker=300 * MIB, available=2**34)
    assert "--nproc 64 starts 64 workers on 2 CPU cores" in str(over.warning())
    with pytest.raises(CapacityError) as e:
        over.check_memory()
    assert "18.8 GiB" in str(e.value) and "Use --nproc 54 or fewer" in str(e.value)
