"""Pipeline stages on two local processes (`--nnodes 2 --pipeline-parallel-size 2`, one device and one stage each,
hidden states and sampled ids between them with jax.experimental.transfer).

Greedy tokens through `jaxllm generate` equal one device's, with a stage of one device or of three (TP=3) on each
node, and only node 0 prints (the generated text, nothing of gloo's); when the leader is killed
mid-run the follower exits non-zero with one line of ours. (The refusal of a layout that does not give each node
whole stages is in tests/test_pipeline.py, with the other bad layouts.)
"""

import signal
import subprocess
import time

import pytest

from jaxllm.bench.server_process import free_port
from tests.test_multihost import (
    TIMEOUT_S,
    assert_one_line_of_ours,
    generate_cmd,
    node_env,
    one_device_text,
    run_nodes,
    wait_for,
)

STAGES = ("--tensor-parallel-size", "1", "--pipeline-parallel-size", "2")


def pp_cmd(rank: int, port: int, *extra: str) -> list[str]:
    return generate_cmd(rank, port, *STAGES, *extra, nnodes=2)


def run_two_nodes(*stages: str) -> str:
    """Node 0's stdout of `jaxllm generate` over two local processes with these layout flags (the follower prints
    nothing)."""
    results = run_nodes(*stages, nnodes=2)
    assert results[1][0] == ""
    return results[0][0]


@pytest.fixture(scope="module")
def expected(llm) -> str:
    return one_device_text(llm)


def test_two_processes_one_stage_each_match_one_device(expected):
    assert run_two_nodes(*STAGES) == expected


def test_two_processes_a_tensor_parallel_stage_each_match_one_device(expected):
    # PP=2 x TP=3: each node's stage runs its own TP collectives over its 3 devices, whose first use makes gloo
    # print "[Gloo] Rank r is connected ..." mid-run: stdout must still be the generated text alone
    assert run_two_nodes("--tensor-parallel-size", "3", "--pipeline-parallel-size", "2") == expected


def test_a_killed_leader_ends_the_follower_with_one_line(tmp_path):
    port = free_port()
    logs = [tmp_path / f"node{rank}.err" for rank in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        cmd = pp_cmd(rank, port, "--max-tokens", "400", "--ignore-eos")
        cmd[cmd.index("WARNING")] = "INFO"
        with open(log, "w") as err:
            procs.append(subprocess.Popen(cmd, env=node_env(), stdout=subprocess.DEVNULL, stderr=err))
    try:
        wait_for("driving 1 follower", logs[0], procs[0])  # both compiled; the steps begin
        wait_for("following node 0's steps", logs[1], procs[1])
        time.sleep(2)
        assert procs[0].poll() is None, "the leader ended before it could be killed"
        procs[0].send_signal(signal.SIGKILL)  # the supervising parent; its engine child dies with it
        killed = time.monotonic()
        assert procs[1].wait(timeout=TIMEOUT_S + 30) != 0, "the follower exited 0 after the leader died"
        assert_one_line_of_ours(1, logs[1].read_text())
        assert time.monotonic() - killed < TIMEOUT_S + 10
    finally:
        for p in procs:
            p.kill()
            p.wait()
