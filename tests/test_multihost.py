"""Multi-host: one TP=3 mesh spread over 3 local processes (`--nnodes 3`, gloo on loopback).

Every rank runs the same `jaxllm generate` command; rank 0 prints. Greedy tokens must equal a
single process's. A follower with no leader exits non-zero with one line within its timeout; one
whose leader dies mid-run exits non-zero within its timeout instead of hanging in a collective.
"""

import os
import signal
import subprocess
import sys
import time

from jaxllm.bench.server_process import free_port
from tests.conftest import TEST_ENGINE, kv_bytes

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TIMEOUT_S = 20


def node_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each node gets jax_num_cpu_devices
    env["JAX_PLATFORMS"] = "cpu"
    return env


def generate_cmd(rank: int, port: int, *extra: str, nnodes: int = 3) -> list[str]:
    return [sys.executable, "-m", "jaxllm.entrypoints.cli", "--log-level", "WARNING", "generate", *PROMPTS,
            "--no-chat-template", "--max-tokens", "12",
            "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]),
            "--max-num-batched-tokens", str(TEST_ENGINE["max_num_batched_tokens"]),
            "--max-model-len", str(TEST_ENGINE["max_model_len"]), "--dtype", "float32",
            "--kv-cache-memory-bytes", str(kv_bytes(64)), "--tensor-parallel-size", str(nnodes),
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-port", str(port),
            "--distributed-timeout", str(TIMEOUT_S), *extra]


def start_nodes(port: int, *extra: str) -> list[subprocess.Popen]:
    return [subprocess.Popen(generate_cmd(rank, port, *extra), env=node_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for rank in range(3)]


def without_gloo_banner(stdout: str) -> str:
    """gloo's C++ side prints one "[Gloo] Rank r is connected to ..." line to stdout when it connects."""
    return "".join(line for line in stdout.splitlines(keepends=True) if not line.startswith("[Gloo] "))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxllm: error:")]


def test_three_processes_match_one(llm):
    from jaxllm import SamplingParams

    procs = start_nodes(free_port())
    results = [p.communicate(timeout=900) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = "".join(f"### {p}\n{p + o.outputs[0].text}\n\n" for p, o in zip(PROMPTS, expected))
    assert without_gloo_banner(results[0][0]) == text
    assert without_gloo_banner(results[1][0]) == without_gloo_banner(results[2][0]) == ""  # followers print nothing


def test_follower_without_leader_exits_with_one_line():
    started = time.monotonic()
    p = subprocess.run(generate_cmd(1, free_port(), nnodes=2)[:-2] + ["--distributed-timeout", "5"],
                       env=node_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert error_lines(p.stderr) == [p.stderr.strip().splitlines()[-1]]
    assert "could not reach the leader" in p.stderr
    assert time.monotonic() - started < 120  # the timeout plus start-up, not JAX's default 300 s


def test_orphaned_followers_exit_within_the_timeout(tmp_path):
    port = free_port()
    leader_log = tmp_path / "leader.err"
    with open(leader_log, "w") as log:
        cmd = generate_cmd(0, port, "--max-tokens", "400", "--ignore-eos")
        cmd[cmd.index("WARNING")] = "INFO"
        leader = subprocess.Popen(cmd, env=node_env(), stdout=subprocess.DEVNULL, stderr=log)
    followers = [subprocess.Popen(generate_cmd(rank, port), env=node_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in (1, 2)]
    try:
        deadline = time.monotonic() + 900
        while "driving 2 follower" not in leader_log.read_text():  # every node compiled; the steps begin
            assert leader.poll() is None and time.monotonic() < deadline, leader_log.read_text()[-2000:]
            time.sleep(0.5)
        time.sleep(2)
        assert leader.poll() is None, "the leader ended before it could be killed"
        leader.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for rank, p in enumerate(followers, 1):
            _, err = p.communicate(timeout=TIMEOUT_S + 60)
            assert p.returncode != 0, f"rank {rank} exited 0 after its leader died"
            # our one line when our watchdog or collective notices first; JAX's coordination client often
            # notices first and aborts the process with its own fatal log naming the cause
            ours = [e for e in error_lines(err) if e.startswith(f"jaxllm: error: node {rank}:")]
            assert len(ours) == 1 or "another task died" in err, err[-2000:]
        assert time.monotonic() - killed < TIMEOUT_S + 30
    finally:
        for p in [leader, *followers]:
            p.kill()
            p.wait()
