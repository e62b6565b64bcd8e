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


def test_host_lists_expand_with_their_padding() -> None:
    assert slurm.hosts("node[07-09,12],gpu1") == ["node07", "node08", "node09", "node12", "gpu1"]
    assert slurm.hosts("fsdpk-node[0-1]") == ["fsdpk-node0", "fsdpk-node1"]
    assert slurm.in_task({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert not slurm.in_task({"SLURM_PROCID": "0"})  # the batch script, a stand-in srun


def test_a_repeated_signal_in_a_slurm_task_is_not_a_second_one() -> None:
    import signal as sig

    from fsdpkit.runtime.signals import StopFlag

    flag = StopFlag()
    flag.repeat_is_second = False  # [Note: repeated SLURM signals]
    flag._handle(sig.SIGTERM, None)
    flag._handle(sig.SIGTERM, None)  # srun's forwarded copy: no os._exit
    assert flag.signum == sig.SIGTERM


def test_a_lost_peer_in_a_slurm_task_names_the_node() -> None:
    env = {
        "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "localhost",
    }  # fmt: skip
    said = slurm.lost_node("[pair.cc:553] Connection closed by peer [127.0.0.1]:34013.", env)
    assert said is not None and said.startswith("lost node localhost at 127.0.0.1 (ranks 1)")
    assert slurm.lost_node("CUDA out of memory", env) is None
