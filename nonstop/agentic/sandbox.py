"""A sandbox that runs model-written Python in a subprocess, with asyncio so the loop never blocks.

    sandbox = Sandbox(SandboxConfig(timeout_s=2.0))
    result = await sandbox.run("print(sum(range(10)))")      # result.stdout == "45\n"

The boundary is the kernel's, whether the trainer runs as root or not. Each run sees its own root
filesystem, built from an allow-list: its scratch directory (`/scratch`, its cwd, writable, removed
afterwards), the interpreter's prefix and the system libraries it loads (read-only), a private
`/tmp` (tmpfs), a minimal `/dev` and its own `/proc`. Nothing else of the host exists in there: no
repository, no grader's files, no other process. `SandboxConfig.isolation` picks the mechanism:

- `bubblewrap`: the `bwrap` binary (Debian's `bubblewrap` package) builds that root, with new
  mount, PID, network, IPC and UTS namespaces (plus a user namespace when not root).
- `namespaces`: the child builds the same root itself: unshare(2) (a user namespace too when not
  root, so it works for any user the kernel lets create one), a fresh tmpfs root, bind mounts,
  pivot_root(2).
- `auto` (the default): bubblewrap if it works here, else namespaces. Where neither works the
  Sandbox refuses to start (`SandboxUnavailable`) rather than run model code unconfined.
- `none`: no boundary, only the limits below and the audit hook; must be chosen explicitly and
  warns, since the model's code then reads whatever the trainer's user can.

Inside either boundary the child drops every capability (as root: it becomes user `nobody`), sets
no_new_privs and its rlimits: RLIMIT_CPU, RLIMIT_AS (allocation fails with MemoryError),
RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_NPROC=0 (no fork, no threads). The child is its own process
group, SIGKILLed past `timeout_s`. `SandboxResult.guards` lists what held for each run.

A Python audit hook (`python_guards`) also refuses sockets, fork/exec, ctypes and writes outside
the scratch directory, so a program gets a clear PermissionError; it is not a boundary (code can
bypass it), only a friendlier first refusal. Tracebacks show only the model's own frames.

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
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
import weakref
from typing import Literal

from nonstop import perf
from nonstop.models.validation import check, check_choice, check_int, check_ints

Isolation = Literal["auto", "bubblewrap", "namespaces", "none"]
KilledReason = Literal["timeout", "cpu_limit", "output_limit", "signal"]
# Exit status the child uses when it cannot set up the boundary the config asked for.
SETUP_FAILED_EXIT = 121
OS_GUARDS = ("wall_timeout", "rlimits", "private_fs", "pid_namespace", "no_network",
             "unprivileged")  # fmt: skip
SCRATCH = "/scratch"  # where the scratch directory appears inside the boundary
# Host paths that may be bound read-only besides the interpreter's prefix (those that exist).
SYSTEM_PATHS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/etc/ld.so.cache")
_RUNNER = "<nonstop-sandbox>"  # the runner's filename; its frames never reach the model
_BOOT = f"import sys; exec(compile(sys.argv[1], {_RUNNER!r}, 'exec'))"


class SandboxUnavailable(RuntimeError):
    """The isolation the config asks for cannot be had on this machine."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run, how many may run at once, and the boundary around them."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS, applied after the interpreter has started
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_output_bytes: int = 16_384  # kept per stream
    kill_output_bytes: int = 4_194_304  # stdout + stderr past this: the child is killed
    max_concurrency: int = 4
    isolation: Isolation = "auto"  # see the module docstring; "none" runs model code unconfined
    python_guards: bool = True  # the audit hook (tests turn it off to prove the kernel alone)
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
        check_choice(owner, "isolation", self.isolation, Isolation)


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
    guards: tuple[str, ...] = ()  # the OS guards that were in force (see OS_GUARDS)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


def _child_main() -> None:  # pragma: no cover - runs in the sandboxed child, stdlib only
    """The child: enter the boundary, set limits, drop privileges, then run the model's code.

    Sent as source to `python -I -S`; everything it needs is imported inside.
    """
    import contextlib
    import ctypes
    import json
    import os
    import platform
    import resource
    import signal
    import sys
    import traceback

    cfg = json.loads(sys.argv[2])
    status_fd, root = cfg["status_fd"], os.getuid() == 0
    guards = ["wall_timeout"]
    libc = ctypes.CDLL(None, use_errno=True)

    def fail(what: str) -> None:
        err = ctypes.get_errno()
        print(f"sandbox: cannot set up isolation={cfg['isolation']!r}: {what}"
              f"{f' ({os.strerror(err)})' if err else ''}", file=sys.stderr)  # fmt: skip
        sys.stderr.flush()
        os._exit(121)

    def enter_namespaces() -> None:
        """unshare + fork into new namespaces, build a root from the allow-list, pivot into it."""
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                               ctypes.c_char_p]  # fmt: skip
        ms_rdonly, ms_nosuid, ms_nodev, ms_noexec, ms_remount, ms_bind = 1, 2, 4, 8, 32, 4096
        ms_rec, ms_private = 16384, 1 << 18
        uid, gid = os.getuid(), os.getgid()
        flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000  # ns pid net ipc uts
        if not root:
            flags |= 0x10000000  # a user namespace: what lets a non-root user do the rest
        if libc.unshare(flags) != 0:
            fail("unshare(2) was refused (no namespaces for this user here)")
        if not root:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):  # fmt: skip
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        pid = os.fork()  # the child is PID 1 of the new PID namespace
        if pid:
            os.close(status_fd)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # die the same way, so the parent sees the signal
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

        def mount(src: str | None, dst: str, fstype: str | None, mflags: int, data: str = ""):
            args = [None if s is None else s.encode() for s in (src, dst, fstype)]
            if libc.mount(args[0], args[1], args[2], mflags, data.encode() or None) != 0:
                fail(f"mount {src} on {dst}")

        def bind(src: str, dst: str, readonly: bool) -> None:
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                open(dst, "a").close()
            mount(src, dst, None, ms_bind | ms_rec)
            # Flags the original mount has are locked in a user namespace: keep them.
            keep = os.statvfs(src).f_flag & (ms_nosuid | ms_nodev | ms_noexec | 1024 | 2048)
            extra = ms_rdonly if readonly else 0
            mount(None, dst, None, ms_remount | ms_bind | ms_nosuid | ms_nodev | keep | extra)

        new = cfg["new_root"]
        mount(None, "/", None, ms_rec | ms_private)
        mount("tmpfs", new, "tmpfs", ms_nosuid | ms_nodev, "size=1m,mode=755")
        for path in cfg["readonly"]:
            if os.path.islink(path):
                os.makedirs(os.path.dirname(new + path), exist_ok=True)
                os.symlink(os.readlink(path), new + path)
            else:
                bind(path, new + path, readonly=True)
        bind(cfg["host_scratch"], new + cfg["scratch"], readonly=False)
        os.makedirs(new + "/tmp")
        mount("tmpfs", new + "/tmp", "tmpfs", ms_nosuid | ms_nodev, "size=64m,mode=1777")
        os.makedirs(new + "/proc")
        mount("proc", new + "/proc", "proc", ms_nosuid | ms_nodev | ms_noexec)
        os.makedirs(new + "/dev")
        mount("tmpfs", new + "/dev", "tmpfs", ms_nosuid | ms_noexec, "size=64k,mode=755")
        for dev in ("null", "zero", "random", "urandom"):
            bind("/dev/" + dev, f"{new}/dev/{dev}", readonly=False)
        number = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
        if number is None:
            fail(f"pivot_root's syscall number on {platform.machine()} is not known")
        os.chdir(new)
        if libc.syscall(number, b".", b".") != 0:
            fail("pivot_root")
        if libc.umount2(b".", 2) != 0:  # MNT_DETACH: the host's root is gone from view
            fail("umount the old root")
        os.chdir("/")
        mount(None, "/", None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | ms_nodev)

    def drop_privileges() -> None:
        if root:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])  # from uid 0 to another: every capability goes
        elif cfg["isolation"] == "namespaces":
            # Capabilities held in the user namespace it created: capset(2) them all away.
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)
            if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
                fail("capset")
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            fail("prctl(PR_SET_NO_NEW_PRIVS)")
        guards.append("unprivileged")

    if cfg["isolation"] == "namespaces":
        enter_namespaces()
    if cfg["isolation"] != "none":
        guards += ["private_fs", "pid_namespace", "no_network"]
    scratch = cfg["scratch"]
    os.chdir(scratch)
    drop_privileges()
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb, cfg["max_file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no new processes or threads
    guards.append("rlimits")
    os.write(status_fd, json.dumps(guards).encode())
    os.close(status_fd)
    with open(os.path.join(scratch, "main.py"), encoding="utf-8") as f:
        source = f.read()

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

    def report(error: BaseException) -> None:
        """The traceback with the runner's frames cut out: the model sees only its own code."""
        kept, tb = [], error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename not in ("<nonstop-sandbox>", "<string>"):
                kept.append(tb)
            tb = tb.tb_next
        for outer, inner in zip(kept, kept[1:], strict=False):
            outer.tb_next = inner
        if kept:
            kept[-1].tb_next = None
        with contextlib.suppress(Exception):
            sys.stdout.flush()  # what it printed before the error, then the error
        traceback.print_exception(type(error), error, kept[0] if kept else None)
        sys.stderr.flush()

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as error:
        report(error)
        os._exit(1)


_CHILD_SOURCE: str | None = None


def _child_source() -> str:
    global _CHILD_SOURCE
    if _CHILD_SOURCE is None:
        _CHILD_SOURCE = textwrap.dedent(inspect.getsource(_child_main)) + "\n_child_main()\n"
    return _CHILD_SOURCE


def _readonly_paths(python: str) -> list[str]:
    """The allow-list: the interpreter's prefix and the system libraries, outermost first."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    paths = [prefix] + [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    return [p for i, p in enumerate(paths)
            if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths[:i])]  # fmt: skip


def _bwrap_args(bwrap: str, readonly: list[str], host_scratch: str) -> list[str]:
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]  # fmt: skip
    if os.getuid() == 0:  # no user namespace: the child keeps only what it needs to become nobody
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns"]
    made: set[str] = set()
    for path in readonly:
        # Parents bwrap would make with the host dirs' modes (0700 for /root): make them 0755.
        parts = path.split("/")[1:-1]
        for parent in ("/" + "/".join(parts[: i + 1]) for i in range(len(parts))):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    args += ["--bind", host_scratch, SCRATCH, "--tmpfs", "/tmp", "--proc", "/proc", "--dev",
             "/dev", "--remount-ro", "/", "--chdir", SCRATCH]  # fmt: skip
    return args


# (isolation, python, uid) -> the mechanism that works, or the reason each failed. Probed once.
_PROBED: dict[tuple[str, str, int], tuple[str | None, str]] = {}


class Sandbox:
    """Runs Python source in an isolated child process; at most `max_concurrency` at once.

    Raises `SandboxUnavailable` when the config's `isolation` cannot be had here."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        try:
            nobody = pwd.getpwnam("nobody")
            self._uid, self._gid = nobody.pw_uid, nobody.pw_gid
        except KeyError:
            self._uid, self._gid = 65534, 65534
        self._readonly = _readonly_paths(self.config.python)
        self._bwrap = shutil.which("bwrap")
        self.isolation: str = self._resolve_isolation()
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _resolve_isolation(self) -> str:
        wanted = self.config.isolation
        if wanted == "none":
            warnings.warn(
                "SandboxConfig.isolation='none': model code runs with no filesystem, process or "
                "network boundary and can read whatever this user can (reward-hacking risk)",
                RuntimeWarning, stacklevel=3,
            )  # fmt: skip
            return "none"
        key = (wanted, self.config.python, os.getuid())
        if key not in _PROBED:
            reasons = []
            for mechanism in ("bubblewrap", "namespaces") if wanted == "auto" else (wanted,):
                why = self._probe(mechanism)
                if why is None:
                    _PROBED[key] = (mechanism, "")
                    break
                reasons.append(f"{mechanism}: {why}")
            else:
                _PROBED[key] = (None, "; ".join(reasons))
        mechanism, why = _PROBED[key]
        if mechanism is None:
            raise SandboxUnavailable(
                f"SandboxConfig.isolation={wanted!r}: no sandbox boundary can be had here ({why}). "
                "Install bubblewrap (apt-get install bubblewrap), allow user namespaces "
                "(sysctl user.max_user_namespaces > 0), or set SandboxConfig.isolation='none' to "
                "run model code with no boundary (it can then read the host's files)"
            )
        return mechanism

    def _probe(self, mechanism: str) -> str | None:
        """Run `pass` under `mechanism`; None if it worked, else why not."""
        if mechanism == "bubblewrap" and self._bwrap is None:
            return "no bwrap binary on PATH (the Debian/Ubuntu package is `bubblewrap`)"
        base = self._make_scratch("pass")
        status_r, status_w = os.pipe()
        try:
            argv, env = self._command(mechanism, base, status_w)
            proc = subprocess.run(argv, env=env, cwd="/", pass_fds=(status_w,), timeout=30,
                                  stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as error:
            return str(error)
        finally:
            os.close(status_w)
            os.close(status_r)
            shutil.rmtree(base, True)
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            return f"exit {proc.returncode}: {err[-1] if err else 'no message'}"
        return None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.config.max_concurrency)
        return self._semaphores[loop]

    async def run(self, code: str, stdin: str | None = None) -> SandboxResult:
        """Run `code` as a script; never raises for anything the code does."""
        async with self._semaphore():
            base = await asyncio.to_thread(self._make_scratch, code)
            try:
                return await self._run_in(base, stdin)
            finally:
                await asyncio.to_thread(shutil.rmtree, base, True)

    def _make_scratch(self, code: str) -> str:
        """`base/scratch` (the run's writable dir, holding main.py) and `base/root` (the mount
        point the namespaces mechanism builds its root on)."""
        base = os.path.realpath(
            tempfile.mkdtemp(prefix="nonstop-sandbox-", dir=self.config.scratch_root)
        )
        os.chmod(base, 0o755)
        scratch = os.path.join(base, "scratch")
        os.mkdir(scratch)
        os.mkdir(os.path.join(base, "root"))
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if os.getuid() == 0:
            os.chown(scratch, self._uid, self._gid)
        return base

    def _command(self, mechanism: str, base: str, status_w: int) -> tuple[list[str], dict]:
        cfg = self.config
        host_scratch = os.path.join(base, "scratch")
        scratch = host_scratch if mechanism == "none" else SCRATCH
        child_cfg = {
            "isolation": mechanism, "scratch": scratch, "host_scratch": host_scratch,
            "new_root": os.path.join(base, "root"), "readonly": self._readonly,
            "status_fd": status_w, "uid": self._uid, "gid": self._gid, "cpu_s": cfg.cpu_s,
            "memory_mb": cfg.memory_mb, "max_file_mb": cfg.max_file_mb,
            "python_guards": cfg.python_guards,
        }  # fmt: skip
        python = os.path.realpath(cfg.python)
        argv = [python, "-I", "-S", "-c", _BOOT, _child_source(), json.dumps(child_cfg)]
        if mechanism == "bubblewrap":
            argv = _bwrap_args(self._bwrap, self._readonly, host_scratch) + argv
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": "/tmp"}
        if mechanism == "none":
            env["TMPDIR"] = scratch
        return argv, env

    async def _run_in(self, base: str, stdin: str | None) -> SandboxResult:
        cfg = self.config
        status_r, status_w = os.pipe()
        argv, env = self._command(self.isolation, base, status_w)
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd="/", pass_fds=(status_w,),
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
        if self.isolation == "bubblewrap" and code is not None and code > 128 and killed is None:
            code = -(code - 128)  # bwrap exits 128 + signal when a signal ended its child
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
