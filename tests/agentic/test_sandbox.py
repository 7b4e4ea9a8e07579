"""The Python sandbox: normal code runs; loops, forks, allocation, writes outside the scratch dir,
sockets and floods are contained and reported; the event loop keeps ticking meanwhile.

Where the OS guards are available (root here) each containment is checked twice: with the
Python audit hook, and with the hook off, so the kernel alone is shown to hold.
"""

import asyncio
import os
import time

import pytest

from nonstop.agentic.sandbox import OS_GUARDS, Sandbox, SandboxConfig
from nonstop.models.validation import ConfigError

FAST = dict(timeout_s=1.5, cpu_s=3, memory_mb=128, max_output_bytes=2048,
            kill_output_bytes=1 << 20)  # fmt: skip


def run(code: str, stdin: str | None = None, **overrides):
    sandbox = Sandbox(SandboxConfig(**{**FAST, **overrides}))
    return asyncio.run(sandbox.run(code, stdin))


@pytest.fixture(scope="module")
def os_guards():
    return run("pass").guards


def layers(os_guards, needed: str):
    """python_guards values to test: always the hook; the kernel alone when it has the guard."""
    return [True, False] if needed in os_guards else [True]


def test_normal_code_stdin_and_clean_environment(monkeypatch):
    monkeypatch.setenv("NONSTOP_TEST_SECRET", "hunter2")
    code = (
        "import os, sys, json, math\n"
        "data = sys.stdin.read()\n"
        "print(math.factorial(10), data.upper())\n"
        "print(json.dumps(sorted(os.environ)))\n"
        "open('out.txt', 'w').write('ok'); print(open('out.txt').read(), os.getcwd() != '/')\n"
    )
    result = run(code, stdin="hello")
    assert result.ok and result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "3628800 HELLO"
    assert "NONSTOP_TEST_SECRET" not in lines[1] and "hunter2" not in result.stdout
    assert lines[2] == "ok True"
    assert not result.truncated and result.killed_reason is None


def test_guards_reported_here(os_guards):
    assert set(os_guards) <= set(OS_GUARDS)
    assert "wall_timeout" in os_guards and "rlimits" in os_guards
    if os.getuid() == 0:  # this container: every OS guard is in force
        assert set(os_guards) == set(OS_GUARDS)


def test_infinite_loop_is_killed_at_the_wall_timeout():
    start = time.perf_counter()
    result = run("while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and result.killed_reason == "timeout"
    assert result.exit_code == -9
    assert 1.0 <= result.duration_s < 1.0 + 1.5 and time.perf_counter() - start < 3.0


def test_cpu_limit_kills_a_busy_child():
    result = run("while True:\n    pass\n", timeout_s=10.0, cpu_s=1)
    assert result.killed_reason == "cpu_limit" and not result.timed_out
    assert result.duration_s < 8.0


@pytest.mark.parametrize("python_guards", [True, False])
def test_fork_and_threads_are_contained(os_guards, python_guards):
    if not python_guards and "unprivileged" not in os_guards:
        pytest.skip("no OS process limit without root")
    code = (
        "import os\n"
        "try:\n    os.fork(); print('forked')\nexcept OSError as e:\n    print('fork refused')\n"
        "import threading\n"
        "try:\n    threading.Thread(target=print).start(); print('thread')\n"
        "except RuntimeError:\n    print('thread refused')\n"
    )
    result = run(code, python_guards=python_guards)
    assert result.stdout.splitlines() == ["fork refused", "thread refused"], result.stderr


def test_fork_bomb_ends_without_harm(os_guards):
    kernel_only = "unprivileged" in os_guards  # never run a real fork bomb unguarded
    result = run("import os\nwhile True:\n    os.fork()\n", python_guards=not kernel_only)
    assert result.exit_code == 1 and result.killed_reason is None
    assert ("BlockingIOError" if kernel_only else "PermissionError") in result.stderr


def test_unbounded_allocation_is_contained():
    result = run("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", memory_mb=96)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


@pytest.mark.parametrize("target", ["/tmp/nonstop_escape_{}.txt", "../nonstop_escape_{}.txt"])
@pytest.mark.parametrize("python_guards", [True, False])
def test_writes_outside_scratch_are_blocked(os_guards, python_guards, target):
    if not python_guards and "readonly_fs" not in os_guards:
        pytest.skip("no read-only mount namespace without root")
    target = target.format(os.getpid())
    code = f"open({target!r}, 'w').write('x')\n"
    result = run(code, python_guards=python_guards)
    assert result.exit_code == 1
    assert ("PermissionError" in result.stderr) or ("Read-only file system" in result.stderr)
    assert not os.path.exists(f"/tmp/nonstop_escape_{os.getpid()}.txt")


@pytest.mark.parametrize("python_guards", [True, False])
def test_socket_to_localhost_is_blocked(os_guards, python_guards):
    if not python_guards and "no_network" not in os_guards:
        pytest.skip("no network namespace available")

    async def main():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "print('connected')\n")  # fmt: skip
        sandbox = Sandbox(SandboxConfig(**FAST, python_guards=python_guards))
        async with server:
            return await sandbox.run(code)

    result = asyncio.run(main())
    assert "connected" not in result.stdout
    assert result.exit_code == 1
    assert ("PermissionError" in result.stderr) or ("Network is unreachable" in result.stderr)


def test_megabytes_of_output_are_truncated():
    result = run("import sys\nsys.stdout.write('y' * 300_000)\nprint('tail', file=sys.stderr)\n")
    assert result.exit_code == 0 and result.truncated
    assert result.stdout == "y" * 2048 + "\n[truncated 297952 bytes]"
    assert result.stderr == "tail\n"


def test_endless_output_is_killed_at_the_output_budget():
    result = run("while True:\n    print('z' * 1000)\n", timeout_s=5.0)
    assert result.killed_reason == "output_limit" and result.truncated
    assert result.duration_s < 4.0


def test_event_loop_keeps_ticking_and_concurrency_is_bounded():
    async def main():
        sandbox = Sandbox(SandboxConfig(**{**FAST, "timeout_s": 0.6, "max_concurrency": 2}))
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        results = await asyncio.gather(*(sandbox.run("while True: pass") for _ in range(4)))
        elapsed = time.perf_counter() - start
        stop.set()
        await tick
        return results, elapsed, lags

    results, elapsed, lags = asyncio.run(main())
    assert all(r.timed_out for r in results)
    assert elapsed >= 2 * 0.6  # two waves of two: the semaphore held the other two back
    assert len(lags) > 50 and max(lags) < 0.2  # the loop never blocked on the children


def test_scratch_dirs_are_removed(tmp_path):
    result = run("open('f', 'w').write('1')\n", scratch_root=str(tmp_path))
    assert result.ok and list(tmp_path.iterdir()) == []


def test_config_validation():
    with pytest.raises(ConfigError, match=r"^SandboxConfig\.timeout_s=0 is invalid; expected a "
                                          r"number of seconds > 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ConfigError, match=r"^SandboxConfig\.memory_mb=0 is invalid; expected an "
                                          r"int >= 1"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ConfigError, match=r"^SandboxConfig\.kill_output_bytes=150 is invalid; "
                                          r"expected an int >= 2 \* max_output_bytes = 200"):
        SandboxConfig(max_output_bytes=100, kill_output_bytes=150)
