"""SLURM's variables (fsdpkit.runtime.slurm) as the torch ones a worker joins with (the
sbatch script through srun: tests/e2e/test_slurm.py)."""

from __future__ import annotations

from fsdpkit.runtime import slurm


def test_slurm_variables_map_to_torch_ones() -> None:
    assert slurm.first_host("gpu[07-09,12],cpu1") == "gpu07" and slurm.first_host("a,b") == "a"
    assert [slurm.tasks_on_node("4(x2),2", n) for n in range(3)] == [4, 4, 2]
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODELIST": "n[3-5]", "SLURM_JOB_ID": "123457",
    }  # fmt: skip
    assert slurm.torch_env(env) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n3", "MASTER_PORT": "13457",
    }  # fmt: skip
    assert "MASTER_PORT" not in slurm.torch_env({**env, "MASTER_PORT": "999"})
    assert slurm.torch_env({**env, "RANK": "0"}) == {}
