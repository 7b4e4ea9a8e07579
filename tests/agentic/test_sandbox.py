"""The Python sandbox: normal code runs; loops, forks, allocation, writes outside the scratch dir,
sockets and floods are contained and reported; the event loop keeps ticking meanwhile.

The boundary's hostile cases (a world-readable file outside the scratch dir, the host's `/`, other
processes in `/proc`, the network, writes, audit-hook bypasses) run with the audit hook off, so the
kernel alone is shown to hold, under each mechanism that works here, both as this test's user and
(when the test runs as root) as the unprivileged user `nobody`.
"""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from nonstop.agentic.envs.python_env import format_result
from nonstop.agentic.sandbox import (
    OS_GUARDS,
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
)
from nonstop.models.validation import ConfigError

REPO = Path(__file__).resolve().parents[2]



def _works(isolation: str) -> bool:
    try:
        Sandbox(SandboxConfig(isolation=isolation))
    except SandboxUnavailable:
        return False
    return True


MECHANISMS = [m for m in ("bubblewrap", "namespaces") if _works(m)]
# The limits' tests need no boundary: where none can be had they still run, unconfined.
FAST = dict(timeout_s=1.5, cpu_s=3, memory_mb=128, max_output_bytes=2048,
            kill_output_bytes=1 << 20, isolation="auto" if MECHANISMS else "none")  # fmt: skip
needs_boundary = pytest.mark.skipif(
    not MECHANISMS, reason="neither bubblewrap nor namespaces work on this machine"
)


def run(code: str, stdin: str | None = None, **overrides) -> SandboxResult:
    sandbox = Sandbox(SandboxConfig(**{**FAST, **overrides}))
    return asyncio.run(sandbox.run(code, stdin))


@pytest.fixture(scope="module")
def os_guards():
    return run("pass").guards


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
    if MECHANISMS:  # a boundary: every OS guard is in force
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
    if not python_guards and "private_fs" not in os_guards:
        pytest.skip("no private filesystem: no boundary on this machine")
    target = target.format(os.getpid())
    code = f"open({target!r}, 'w').write('x')\n"
    result = run(code, python_guards=python_guards)
    assert result.exit_code == 1
    assert ("PermissionError" in result.stderr) or ("Read-only file system" in result.stderr) or (
        "No such file or directory" in result.stderr
    )
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
    # The hook refuses; the kernel's namespace has no route there, or (bubblewrap brings its own
    # loopback up) nothing listening on it: the host's server is out of reach either way.
    assert any(error in result.stderr for error in
               ("PermissionError", "Network is unreachable", "ConnectionRefusedError"))  # fmt: skip


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


# The model's side of the hostile cases: each probe prints one JSON line of what it could reach.
HOSTILE = r"""
import json, os, socket, sys
secret, port, repo = sys.argv_secret, sys.argv_port, sys.argv_repo
out = {}
def attempt(name, fn):
    try:
        out[name] = fn()
    except Exception as error:
        out[name] = "refused: " + type(error).__name__
attempt("read_secret", lambda: open(secret).read())
attempt("list_secret_dir", lambda: os.listdir(os.path.dirname(secret)))
attempt("root", lambda: sorted(os.listdir("/")))
attempt("repo", lambda: os.listdir(repo))
attempt("pids", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
attempt("connect", lambda: socket.create_connection(("127.0.0.1", port), timeout=1) and "open")
attempt("write_outside", lambda: open(os.path.dirname(secret) + "/planted", "w").write("x"))
attempt("write_usr", lambda: open(sys.prefix + "/planted", "w").write("x"))
# An audit hook's usual bypasses: a replaced sys.audit, and sqlite3 writing through C.
sys.audit = lambda *args: None
def sqlite_outside():
    import sqlite3
    sqlite3.connect(os.path.dirname(secret) + "/planted.db").execute("create table t(x)")
    return "written"
attempt("sqlite_outside", sqlite_outside)
attempt("scratch_write", lambda: open("ok.txt", "w").write("fine"))
print(json.dumps(out))
"""


def hostile_code(secret: Path, port: int) -> str:
    head = (f"import sys\nsys.argv_secret = {str(secret)!r}\nsys.argv_port = {port}\n"
            f"sys.argv_repo = {str(REPO)!r}\n")  # fmt: skip
    return head + HOSTILE


@pytest.fixture()
def secret_and_port():
    """A world-readable answer file (0644 in a 0755 dir) outside any scratch dir, and a port
    listening on 127.0.0.1, both on the host."""
    folder = Path(tempfile.mkdtemp(prefix="nonstop-grader-"))
    folder.chmod(0o755)
    secret = folder / "answers.txt"
    secret.write_text("the answer is 42")
    secret.chmod(0o644)
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    yield secret, server.getsockname()[1]
    server.close()
    shutil.rmtree(folder)


def assert_contained(report: dict, secret: Path) -> None:
    assert report["read_secret"].startswith("refused"), report
    assert report["list_secret_dir"].startswith("refused"), report
    assert report["repo"].startswith("refused"), report
    assert set(report["root"]) <= {"dev", "proc", "tmp", "scratch", "usr", "lib", "lib64", "etc",
                                   "root", "bin", "opt", "home"}, report  # fmt: skip
    assert len(report["pids"]) <= 3, report  # the sandbox's own (an init, its runner)
    assert report["connect"].startswith("refused"), report
    for name in ("write_outside", "write_usr", "sqlite_outside"):
        assert report[name].startswith("refused"), (name, report)
    assert report["scratch_write"] == 4, report
    assert sorted(p.name for p in secret.parent.iterdir()) == ["answers.txt"]


@needs_boundary
@pytest.mark.parametrize("isolation", MECHANISMS)
def test_hostile_code_sees_nothing_of_the_host(isolation, secret_and_port):
    secret, port = secret_and_port
    assert secret.read_text() == "the answer is 42"  # the host itself can read it
    result = run(hostile_code(secret, port), isolation=isolation, python_guards=False)
    assert result.ok, result.stderr
    assert_contained(json.loads(result.stdout), secret)
    with_hook = run(hostile_code(secret, port), isolation=isolation, python_guards=True)
    assert_contained(json.loads(with_hook.stdout), secret)


UNPRIVILEGED_RUNNER = """
import asyncio, json, os, sys
from nonstop.agentic.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
isolation, code = sys.argv[1], sys.stdin.read()
assert os.getuid() != 0 and open(sys.argv[2]).read() == "the answer is 42"  # the host user can
try:
    sandbox = Sandbox(SandboxConfig(isolation=isolation, python_guards=False, timeout_s=10))
except SandboxUnavailable as error:
    print(json.dumps({"unavailable": str(error)}))
    raise SystemExit
result = asyncio.run(sandbox.run(code))
print(json.dumps({"stdout": result.stdout, "stderr": result.stderr, "ok": result.ok,
                  "uid": os.getuid()}))
"""


def run_as_nobody(isolation: str, code: str, secret: Path) -> dict:
    """Run the Sandbox from a trainer process of user `nobody` (uid 65534, no capabilities).

    This interpreter may live under a directory `nobody` cannot enter (pyenv under /root): in a
    private mount namespace that directory is covered with an empty tmpfs and the prefix is bound
    back in, so `nobody` can start it, and nothing else changes."""
    prefix = os.path.realpath(sys.base_prefix)
    closed = next((str(p) for p in reversed(Path(prefix).parents)
                   if str(p) != "/" and not p.stat().st_mode & 0o001), None)  # fmt: skip
    cover = ""
    if closed is not None:
        cover = (f'stage=$(mktemp -d); mount --bind "{prefix}" "$stage"; '
                 f'mount -t tmpfs -o mode=755 tmpfs "{closed}"; mkdir -p "{prefix}"; '
                 f'mount --move "$stage" "{prefix}"; ')  # fmt: skip
    drop = ("setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all "
            "--bounding-set=-all")  # fmt: skip
    script = (f"set -e; {cover}exec {drop} {sys.executable} -c "
              f"'{UNPRIVILEGED_RUNNER}' {isolation} {secret}")  # fmt: skip
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script],
        input=code, capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
                    reason="needs root (to become nobody) and util-linux setpriv/unshare")
@pytest.mark.parametrize("isolation", ["bubblewrap", "namespaces"])
def test_hostile_code_is_contained_when_the_trainer_is_not_root(isolation, secret_and_port):
    if not os.access(REPO, os.R_OK) or not REPO.stat().st_mode & 0o005:
        pytest.skip(f"{REPO} is not readable by other users, so nobody cannot import nonstop")
    secret, port = secret_and_port
    answer = run_as_nobody(isolation, hostile_code(secret, port), secret)
    if "unavailable" in answer:
        # Not silent: say which mechanism this kernel/container refuses to unprivileged users.
        pytest.skip(f"{isolation} unavailable without root here: {answer['unavailable']}")
    assert answer["uid"] == 65534 and answer["ok"], answer
    assert_contained(json.loads(answer["stdout"]), secret)


def test_unavailable_isolation_is_refused_and_names_the_opt_out(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.raises(SandboxUnavailable, match=r"isolation='bubblewrap'.*no bwrap binary.*"
                                                 r"SandboxConfig\.isolation='none'"):  # fmt: skip
        Sandbox(SandboxConfig(isolation="bubblewrap", python="/usr/bin/python3"))
    with pytest.warns(RuntimeWarning, match="isolation='none'"):
        sandbox = Sandbox(SandboxConfig(**{**FAST, "isolation": "none"}))
    assert asyncio.run(sandbox.run("print(2 + 2)")).stdout == "4\n"


def test_tracebacks_show_only_the_models_code():
    syntax = run("x = 1\ndef f(:\n    pass\n")
    assert syntax.exit_code == 1
    assert syntax.stderr.startswith('  File "main.py", line 2\n'), syntax.stderr
    assert "SyntaxError" in syntax.stderr and "nonstop-sandbox" not in syntax.stderr
    error = run("print('before')\ndef f():\n    return 1 / 0\nf()\n")
    assert error.stdout == "before\n"
    frames = [line for line in error.stderr.splitlines() if line.startswith("  File ")]
    assert frames == ['  File "main.py", line 4, in <module>', '  File "main.py", line 3, in f']
    hooked = run("open('/usr/planted', 'w')\n", python_guards=True)
    assert "PermissionError" in hooked.stderr and "<nonstop-sandbox>" not in hooked.stderr
    assert [line for line in hooked.stderr.splitlines() if line.startswith("  File ")] == [
        '  File "main.py", line 1, in <module>'
    ]


def test_a_tool_result_cut_for_length_still_says_it_was_killed_and_why():
    result = run("while True:\n    print('z' * 1000)\n", timeout_s=5.0)
    text = format_result(result, max_chars=500)
    assert len(text) <= 500 and text.startswith("zzz")
    assert text.endswith("[killed: printed more output than the sandbox allows]"), text[-200:]
    assert "cut" in text
    slow = run("print('x' * 5000)\nwhile True:\n    pass\n", timeout_s=1.0)
    text = format_result(slow, max_chars=300)
    assert len(text) <= 300 and "[killed: timed out after 1." in text
