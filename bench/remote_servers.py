"""`nonstop serve` processes for the benchmarks' remote backend: write a model as a checkpoint,
start servers on it on free loopback ports, wait until each answers /health, stop them at exit.

    with serving(model, servers=2, engine=EngineConfig(max_slots=64, max_len=72)) as urls:
        engine = RemoteEngine(urls, max_len=72, policy=model)

Each server runs `engine` whole: its `max_slots` and `max_len` as flags, every other field that
differs from `EngineConfig`'s default as an `--engine KEY=VALUE` flag.

The checkpoint's tokenizer is a WordLevel one with exactly the model's vocabulary (token i is
the word `t{i}`, no special tokens), so every id the benchmarks send is in the server's
vocabulary and decodes to text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import tokenizers

from nonstop.engine import EngineConfig
from nonstop.models import Tokenizer, save_pretrained

STARTUP_TIMEOUT_S = 600.0  # loading and compiling on a shared 2-core CPU


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i <-> the word `t{i}`, for i < vocab_size; no special tokens."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, source=f"word_tokenizer({vocab_size})")


def write_checkpoint(model, directory: Path) -> Path:
    """`model` (its weights in their own dtype) and `word_tokenizer` in `directory`."""
    save_pretrained(model, directory)
    word_tokenizer(model.cfg.vocab_size).save_pretrained(directory)
    return directory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, log: Path,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Return once `url`/health answers 200; raise with the end of the server's `log` if the
    process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"nonstop serve exited with {process.returncode} ({log}):\n"
                               f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nonstop serve not healthy after {timeout_s:.0f} s "
                               f"({log}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)


def engine_flags(engine: EngineConfig) -> list[str]:
    """`nonstop serve` flags that give a server's engine exactly `engine`."""
    flags = ["--max-slots", str(engine.max_slots), "--max-len", str(engine.max_len)]
    default = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        value = getattr(engine, field.name)
        if field.name not in ("max_slots", "max_len") and value != getattr(default, field.name):
            flags += ["--engine", f"{field.name}={json.dumps(value)}"]  # JSON is YAML
    return flags


@contextlib.contextmanager
def serving(model, *, servers: int, engine: EngineConfig, dtype: str = "float32",
            api_key: str | None = None, workdir: Path | None = None) -> Iterator[list[str]]:
    """Yield the base URLs of `servers` `nonstop serve` processes on `model`'s weights (started
    together, each healthy; `dtype`: their compute dtype); terminate them (kill if they linger)
    on exit. Logs go to `workdir` (default: a temporary directory, removed afterwards) as
    server{i}.log."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-")))
        checkpoint = write_checkpoint(model, workdir / "checkpoint")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("NONSTOP_API_KEY", None)
        started = []
        for i in range(servers):
            port = free_port()
            log = workdir / f"server{i}.log"
            command = [sys.executable, "-m", "nonstop.cli.serve", str(checkpoint),
                       "--host", "127.0.0.1", "--port", str(port), *engine_flags(engine),
                       "--dtype", dtype, "--log-level", "warning"]
            if api_key is not None:
                command += ["--api-key", api_key]
            out = stack.enter_context(log.open("wb"))
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            stack.callback(_stop, process)
            started.append((process, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for process, url, log in started:
            wait_healthy(process, url, log, max(1.0, deadline - time.monotonic()))
        yield [url for _, url, _ in started]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)
