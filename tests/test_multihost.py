"""Multi-host: one TP=3 mesh spread over 3 local processes (`--nnodes 3`, gloo on loopback).

Greedy tokens must equal a single process's, through `jaxllm generate` (every rank runs the same
command; rank 0's stdout is the generated text and nothing else, the others' is empty) and through
`jaxllm serve` on rank 0 with `--headless` followers; stopping the server stops the followers.
A follower with no leader exits non-zero with one line within its timeout; when a node dies
mid-run, every other node exits non-zero with exactly one line of ours (not JAX's fatal log)
within the timeout.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx

from jaxllm.bench.server_process import free_port
from tests.conftest import serve_flags

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TIMEOUT_S = 20
STARTUP_S = 900  # three processes loading and compiling on two shared cores


def node_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each node gets jax_num_cpu_devices
    env["JAX_PLATFORMS"] = "cpu"
    return env


def engine_flags(rank: int, port: int, nnodes: int = 3) -> list[str]:
    return [
        *serve_flags(64),
        "--tensor-parallel-size",
        str(nnodes),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(rank),
        "--master-port",
        str(port),
        "--distributed-timeout",
        str(TIMEOUT_S),
    ]


def generate_cmd(rank: int, port: int, *extra: str, nnodes: int = 3) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxllm.entrypoints.cli",
        "--log-level",
        "WARNING",
        "generate",
        *PROMPTS,
        "--no-chat-template",
        "--max-tokens",
        "12",
        *engine_flags(rank, port, nnodes),
        *extra,
    ]


def run_nodes(*extra: str, nnodes: int = 3) -> list[tuple[str, str]]:
    """Every node's (stdout, stderr) of `jaxllm generate` over `nnodes` local processes; each must exit 0. A node
    still running when the waiting ends (a timeout, a failed assertion) is killed."""
    port = free_port()
    procs = [
        subprocess.Popen(
            generate_cmd(rank, port, *extra, nnodes=nnodes),
            env=node_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nnodes)
    ]
    try:
        results = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return results


def one_device_text(llm) -> str:
    """What `jaxllm generate PROMPTS --max-tokens 12` prints when run on one device."""
    from jaxllm import SamplingParams

    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return "".join(f"### {p}\n{p + o.outputs[0].text}\n\n" for p, o in zip(PROMPTS, expected, strict=True))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxllm: error:")]


def assert_one_line_of_ours(rank: int, stderr: str) -> None:
    """Exactly one error line, ours, naming the node, and last: JAX's fatal log was replaced."""
    assert error_lines(stderr) == [stderr.strip().splitlines()[-1]], stderr[-3000:]
    assert error_lines(stderr)[0].startswith(f"jaxllm: error: node {rank}:"), stderr[-3000:]
    assert "another task died" not in stderr and "Check failure stack trace" not in stderr, stderr[-3000:]


def wait_for(text: str, log, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def test_three_processes_match_one(llm):
    results = run_nodes()
    text = one_device_text(llm)
    # stdout read whole: the generated text and nothing else (gloo's "[Gloo] Rank r is connected ..." goes to stderr)
    assert results[0][0] == text
    assert results[1][0] == results[2][0] == ""  # followers print nothing
    assert all("[Gloo] Rank" in err for _, err in results)  # gloo did connect (the check above is not vacuous)


def test_follower_without_leader_exits_with_one_line():
    started = time.monotonic()
    p = subprocess.run(
        generate_cmd(1, free_port(), nnodes=2)[:-2] + ["--distributed-timeout", "5"],
        env=node_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    assert error_lines(p.stderr) == [p.stderr.strip().splitlines()[-1]]
    assert "could not reach the leader" in p.stderr
    assert time.monotonic() - started < 120  # the timeout plus start-up, not JAX's default 300 s


def test_serve_with_headless_followers_matches_one_process(llm, tmp_path):
    """`jaxllm serve` on node 0 and `jaxllm serve --headless` on nodes 1-2; SIGTERM to the server stops all three."""
    from jaxllm import SamplingParams

    port, http_port = free_port(), free_port()
    logs = [tmp_path / f"node{rank}.err" for rank in range(3)]
    procs = []
    for rank, log in enumerate(logs):
        role = ["--port", str(http_port)] if rank == 0 else ["--headless"]
        with open(log, "w") as err:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "jaxllm.entrypoints.cli",
                        "serve",
                        *engine_flags(rank, port),
                        *role,
                        "--disable-log-stats",
                    ],
                    env=node_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    try:
        wait_for("Uvicorn running on", logs[0], procs[0])
        prompts = [*PROMPTS, "Once upon a time", "1, 2, 3, 4,"]

        def complete(prompt: str) -> str:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            response = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # in flight together
            served = list(pool.map(complete, prompts))
        expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert served == [o.outputs[0].text for o in expected]

        procs[0].send_signal(signal.SIGTERM)
        for rank, p in enumerate(procs):
            assert p.wait(timeout=TIMEOUT_S + 30) == 0, logs[rank].read_text()[-3000:]
        for log in logs[1:]:
            assert "leader said stop" in log.read_text() and not error_lines(log.read_text())
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_lost_node_ends_every_other_node_with_one_line(tmp_path):
    """Node 2 dies mid-run: the leader reports it, and node 1, orphaned when the leader exits, does too."""
    port = free_port()
    logs = [tmp_path / f"node{rank}.err" for rank in range(3)]
    procs = []
    for rank, log in enumerate(logs):
        cmd = generate_cmd(rank, port, "--max-tokens", "400", "--ignore-eos")  # the same buckets: compiled already
        cmd[cmd.index("WARNING")] = "INFO"
        with open(log, "w") as err:
            procs.append(subprocess.Popen(cmd, env=node_env(), stdout=subprocess.DEVNULL, stderr=err))
    try:
        wait_for("driving 2 follower", logs[0], procs[0])  # every node compiled; the steps begin
        time.sleep(2)
        assert procs[0].poll() is None, "the leader ended before node 2 could be killed"
        procs[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for rank in (0, 1):
            assert procs[rank].wait(timeout=TIMEOUT_S + 30) != 0, f"node {rank} exited 0 after node 2 died"
            assert_one_line_of_ours(rank, logs[rank].read_text())
        assert time.monotonic() - killed < TIMEOUT_S + 10
    finally:
        for p in procs:
            p.kill()
            p.wait()


FATAL_LOG = (
    "E1203 07:31:41.564791   18994 coordination_service_agent.cc:289] Polled an error from coordination "
    "service (this can be an error from this or another task).\n"
    "F1203 07:31:41.564819   18994 client.h:80] Terminating process because the JAX distributed service "
    "detected fatal errors. This most likely indicates that another task died; see the other task logs for "
    "more details. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader "
    "task was preempted/died/restarted unexpectedly or this task is experiencing network issues.\n"
    "*** Check failure stack trace: ***\n    @     0x7f2480f0cd5b  std::_Function_handler<>::_M_invoke()\n"
)


def test_supervisor_replaces_jax_fatal_log_with_one_line(capfd):
    """The parent's stderr filter: a child that dies of JAX's fatal log leaves one line of ours and exit status 3."""
    from jaxllm.distributed import supervisor

    script = (
        f"import os, sys; sys.stderr.write('INFO loading\\r50%\\r100%\\n' + {FATAL_LOG!r}); "
        "sys.stderr.flush(); os.abort()"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    status = supervisor._pass_stderr(child.stderr)
    assert child.wait() != 0
    assert status == "UNAVAILABLE: Failed to send RPC to coordination service"
    err = capfd.readouterr().err
    assert (
        err == "INFO loading\r50%\r100%\nE1203 07:31:41.564791   18994 coordination_service_agent.cc:289] "
        "Polled an error from coordination service (this can be an error from this or another task).\n"
    )
