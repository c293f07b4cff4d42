"""Two processes x 4 simulated CPU devices = one 8-device ring, through jax.distributed (gloo).

A peer that never arrives, or dies mid-run, makes the job fail with a clear error within its
timeout instead of hanging.
"""

import pytest

from tests.distributed.launch import ProcessFailed, launch_local

WORKER = "tests.distributed.ring_check"


def test_two_processes_run_both_collective_matmuls_over_eight_devices():
    outs = launch_local(WORKER, 2, devices_per_process=4, timeout=90)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK 0 8", "OK 1 8"]


def test_a_peer_that_never_arrives_fails_within_the_timeout():
    with pytest.raises(ProcessFailed, match=r"process 0 of 2 exited with code|still running"):
        launch_local(WORKER, 2, devices_per_process=4, timeout=4, start=[0])


def test_a_peer_that_dies_fails_the_job_within_the_timeout():
    with pytest.raises(ProcessFailed, match=r"process 1 of 2 exited with code 3|still running"):
        launch_local(
            WORKER, 2, devices_per_process=4, timeout=15, extra_args=("--crash-process", "1")
        )
