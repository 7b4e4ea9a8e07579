"""A sandbox that runs model-written Python in a subprocess, with asyncio so the loop never blocks.

    sandbox = Sandbox(SandboxConfig(timeout_s=2.0))
    result = await sandbox.run("print(sum(range(10)))")      # result.stdout == "45\n"

Each run gets a fresh scratch directory (its cwd, removed afterwards), a clean environment with no
inherited variables, an isolated interpreter (`python -I -S`: no site-packages, no user paths, no
PYTHON* variables) and these guards, in two layers:

OS-enforced (the kernel refuses; reported per run in `SandboxResult.guards`):
- `wall_timeout`: the child is its own process group; past `timeout_s` the group is SIGKILLed.
- `rlimits`: RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space: allocation fails with
  MemoryError), RLIMIT_FSIZE (largest file), RLIMIT_NOFILE.
- `no_network`: the child enters a new network namespace (only a downed loopback), so connect()
  fails even to 127.0.0.1. Needs root (or unprivileged user namespaces, tried second).
- `readonly_fs`: the child enters a new mount namespace in which every mount is remounted
  read-only except a bind mount of its scratch directory; /root is covered with an empty tmpfs
  (hiding its files; the interpreter is bound back in if it lives there). Needs root.
- `unprivileged`: the child drops to user `nobody` (all capabilities gone) after setting up the
  namespaces, then sets RLIMIT_NPROC=0, so fork/clone and thread creation fail. Needs root.

Python-level (an audit hook installed before the model's code runs; it cannot be removed, but an
audit hook is not a security boundary on its own): refuses socket creation, fork/exec/spawn/
subprocess/os.system, ctypes, and file writes, renames, deletes and mkdirs outside the scratch
directory. Without root the OS guards that need it are absent and only this layer holds them.

Output (stdout and stderr each) is kept up to `max_output_bytes`; past `kill_output_bytes` in all
the child is killed, so a program that prints gigabytes costs the loop little.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import weakref
from typing import Literal

from nonstop import perf
from nonstop.models.validation import check, check_int, check_ints

KilledReason = Literal["timeout", "cpu_limit", "output_limit", "signal"]
# Exit status the child uses when it cannot set up a guard the config requires.
SETUP_FAILED_EXIT = 121


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run and how many may run at once."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS, applied after the interpreter has started
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_output_bytes: int = 16_384  # kept per stream
    kill_output_bytes: int = 4_194_304  # stdout + stderr past this: the child is killed
    max_concurrency: int = 4
    python_guards: bool = True  # the audit hook (tests turn it off to prove the OS layer alone)
    require_os_isolation: bool = False  # refuse to run unless every OS guard could be set up
    python: str = sys.executable
    scratch_root: str | None = None  # where scratch dirs are made; None: the system temp dir

    def __post_init__(self) -> None:
        owner = "SandboxConfig"
        check(self.timeout_s > 0, owner, "timeout_s", self.timeout_s, "a number of seconds > 0")
        check_ints(owner, self, ("cpu_s", "memory_mb", "max_file_mb", "max_output_bytes"))
        check(self.kill_output_bytes >= 2 * self.max_output_bytes, owner, "kill_output_bytes",
              self.kill_output_bytes,
              f"an int >= 2 * max_output_bytes = {2 * self.max_output_bytes}")
        check_int(owner, "max_concurrency", self.max_concurrency)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one run produced. `exit_code` is negative (-signal) when a signal ended the child."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    killed_reason: KilledReason | None
    truncated: bool
    duration_s: float
    guards: tuple[str, ...] = ()  # the OS guards that were in force (see the module docstring)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


OS_GUARDS = ("wall_timeout", "rlimits", "no_network", "readonly_fs", "unprivileged")


def _child_main() -> None:  # pragma: no cover - runs in the sandboxed child, stdlib only
    """The child: set up namespaces, limits and privileges, then run the model's code.

    Sent as source to `python -I -S -c`; everything it needs is imported inside.
    """
    import ctypes
    import json
    import os
    import resource
    import sys
    import traceback

    cfg = json.loads(sys.argv[1])
    scratch, status_fd = cfg["scratch"], cfg["status_fd"]
    guards = ["wall_timeout"]
    with open(os.path.join(scratch, "main.py"), encoding="utf-8") as f:
        source = f.read()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]  # fmt: skip
    newns, newnet, newuser = 0x00020000, 0x40000000, 0x10000000
    ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 1, 32, 4096, 16384, 1 << 18
    keep = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
            "relatime": 1 << 21}  # fmt: skip
    root = os.getuid() == 0

    def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str = "") -> bool:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        return libc.mount(enc(src), enc(dst), enc(fstype), flags, data.encode() or None) == 0

    if root and libc.unshare(newns | newnet) == 0:
        guards.append("no_network")
        ok = mount(None, "/", None, ms_rec | ms_private)
        ok = ok and mount(scratch, scratch, None, ms_bind)
        base = os.path.realpath(sys.base_prefix)
        if ok and os.path.isdir("/root"):
            fd = os.open(base, os.O_PATH | os.O_DIRECTORY) if base.startswith("/root/") else -1
            ok = mount("tmpfs", "/root", "tmpfs", 0, "size=64k,mode=755")
            if ok and fd >= 0:
                os.makedirs(base, exist_ok=True)
                ok = mount(f"/proc/self/fd/{fd}", base, None, ms_bind | ms_rec)
                os.close(fd)
        if ok:
            with open("/proc/self/mountinfo") as f:
                mounts = [line.split() for line in f]
            for fields in mounts:
                point = fields[4].encode().decode("unicode_escape")
                if point == scratch:
                    continue
                flags = ms_remount | ms_bind | ms_rdonly
                flags |= sum(keep.get(o, 0) for o in fields[5].split(","))
                # A shadowed mount is reached through its path's top mount, remounted as well.
                ok = mount(None, point, None, flags) and ok
        if ok:
            guards.append("readonly_fs")
    elif libc.unshare(newuser | newnet) == 0:
        guards.append("no_network")
    os.chdir(scratch)
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb, cfg["max_file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    guards.append("rlimits")
    if root:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        # After setuid (so the uid switch itself is not refused): no new processes or threads.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        guards.append("unprivileged")
    os.write(status_fd, json.dumps(guards).encode())
    os.close(status_fd)
    if cfg["require_os"] and len(guards) < cfg["n_os_guards"]:
        print(f"sandbox: OS isolation unavailable, only {guards}", file=sys.stderr)
        sys.exit(121)

    if cfg["python_guards"]:
        real_scratch = os.path.realpath(scratch)
        write_bits = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
        refused = ("socket.", "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn",
                   "os.spawn", "subprocess.Popen", "pty.spawn", "ctypes.", "os.kill", "os.killpg",
                   "sys.remote_exec", "os.startfile")  # fmt: skip
        path_events = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1,
                       "os.chmod": 1, "os.chown": 1, "os.link": 2, "os.symlink": 2,
                       "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1}  # fmt: skip

        def inside(path: object) -> bool:
            if isinstance(path, int):
                return True  # an fd already opened under these rules
            path = os.fsdecode(path)  # type: ignore[arg-type]
            real = os.path.realpath(path)
            return real == os.devnull or real == real_scratch or real.startswith(real_scratch + "/")

        def hook(event: str, args: tuple) -> None:
            if event == "open":
                path, mode, flags = args
                writes = (flags & write_bits) if mode is None else any(c in mode for c in "wax+")
                if writes and path is not None and not inside(path):
                    raise PermissionError(f"sandbox: writing outside the scratch dir: {path!r}")
            elif event in path_events:
                for path in args[: path_events[event]]:
                    if path is not None and not inside(path):
                        raise PermissionError(f"sandbox: {event} outside the scratch dir: {path!r}")
            elif event.startswith(refused):
                raise PermissionError(f"sandbox: {event} is not allowed")

        sys.addaudithook(hook)

    code = compile(source, "main.py", "exec")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


_CHILD_SOURCE: str | None = None


def _child_source() -> str:
    global _CHILD_SOURCE
    if _CHILD_SOURCE is None:
        _CHILD_SOURCE = textwrap.dedent(inspect.getsource(_child_main)) + "\n_child_main()\n"
    return _CHILD_SOURCE


class _Capture:
    """Reads one pipe to EOF, keeping the first `limit` bytes and counting the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader, over: asyncio.Event, budget: list[int]):
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            if len(self.kept) < self.limit:
                self.kept += chunk[: self.limit - len(self.kept)]
            budget[0] -= len(chunk)
            if budget[0] < 0:
                over.set()

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        if self.total > len(self.kept):
            text += f"\n[truncated {self.total - len(self.kept)} bytes]"
        return text


class Sandbox:
    """Runs Python source in an isolated child process; at most `max_concurrency` at once."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        try:
            nobody = pwd.getpwnam("nobody")
            self._uid, self._gid = nobody.pw_uid, nobody.pw_gid
        except KeyError:
            self._uid, self._gid = 65534, 65534
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.config.max_concurrency)
        return self._semaphores[loop]

    async def run(self, code: str, stdin: str | None = None) -> SandboxResult:
        """Run `code` as a script; never raises for anything the code does."""
        async with self._semaphore():
            scratch = await asyncio.to_thread(self._make_scratch, code)
            try:
                return await self._run_in(scratch, stdin)
            finally:
                await asyncio.to_thread(shutil.rmtree, scratch, True)

    def _make_scratch(self, code: str) -> str:
        scratch = os.path.realpath(
            tempfile.mkdtemp(prefix="nonstop-sandbox-", dir=self.config.scratch_root)
        )
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if os.getuid() == 0:
            os.chown(scratch, self._uid, self._gid)
        return scratch

    async def _run_in(self, scratch: str, stdin: str | None) -> SandboxResult:
        cfg = self.config
        status_r, status_w = os.pipe()
        child_cfg = {
            "scratch": scratch, "status_fd": status_w, "uid": self._uid, "gid": self._gid,
            "cpu_s": cfg.cpu_s, "memory_mb": cfg.memory_mb, "max_file_mb": cfg.max_file_mb,
            "python_guards": cfg.python_guards, "require_os": cfg.require_os_isolation,
            "n_os_guards": len(OS_GUARDS),
        }  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch}
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                cfg.python, "-I", "-S", "-c", _child_source(), json.dumps(child_cfg),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd=scratch, pass_fds=(status_w,),
                start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(status_w)
        out, err = _Capture(cfg.max_output_bytes), _Capture(cfg.max_output_bytes)
        over, budget = asyncio.Event(), [cfg.kill_output_bytes]
        readers = asyncio.gather(
            out.drain(proc.stdout, over, budget), err.drain(proc.stderr, over, budget),
            self._feed(proc, stdin), proc.wait(),
        )  # fmt: skip
        over_wait = asyncio.ensure_future(over.wait())
        killed: KilledReason | None = None
        try:
            done, _ = await asyncio.wait(
                {readers, over_wait}, timeout=cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if readers not in done:
                killed = "output_limit" if over_wait in done else "timeout"
                _kill_group(proc.pid)
                await readers
        except BaseException:
            _kill_group(proc.pid)
            readers.cancel()
            with contextlib.suppress(BaseException):
                await proc.wait()
            raise
        finally:
            over_wait.cancel()
            guards = _read_status(status_r)
        code = proc.returncode
        if killed is None and code is not None and code < 0:
            # SIGXCPU at the soft CPU limit, SIGKILL at the hard one (nobody else kills it).
            cpu = code in (-signal.SIGXCPU, -signal.SIGKILL)
            killed = "cpu_limit" if cpu else "signal"
        if killed is not None:
            perf.count(f"sandbox/killed_{killed}")
        return SandboxResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=code,
            timed_out=killed == "timeout",
            killed_reason=killed,
            truncated=out.total > len(out.kept) or err.total > len(err.kept),
            duration_s=time.perf_counter() - start,
            guards=guards,
        )

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, stdin: str | None) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if stdin:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
            proc.stdin.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_status(fd: int) -> tuple[str, ...]:
    """The guards the child reported (empty if it died before reporting)."""
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 65536)
    except (BlockingIOError, OSError):
        data = b""
    finally:
        os.close(fd)
    try:
        guards = json.loads(data)
    except ValueError:
        return ()
    return tuple(g for g in guards if g in OS_GUARDS)
