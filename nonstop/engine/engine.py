"""`Engine`: continuous-batching inference over one model, with an asyncio client API.

    engine = Engine(model, EngineConfig(max_slots=16, max_len=1024), tokenizer=tok)
    with engine:                                   # start(): warm-up compiles, thread starts
        c = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=64))
        c.tokens, c.logprobs, c.finish_reason, c.policy_versions

        with engine.session() as s:                # multi-turn: the slot's cache is kept
            c1 = await engine.generate(ctx, params, session=s)
            c2 = await engine.generate(ctx + c1.tokens + tool_ids, params, session=s)

        engine.update_weights(nnx.state(trained), version=3)   # between two device steps

`generate` may be awaited from any number of tasks; the scheduler thread resolves each future
with `loop.call_soon_threadsafe`. Cancelling the awaiting task frees the request's slot. A bad
request (empty or too long prompt, ids outside the vocabulary, invalid sampling values, stop
strings without a tokenizer) raises `RequestError` in its caller only. Compilation happens once
at `start()` (decode, and prefill for each chunk size); `stats().traces` shows it never again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nonstop.engine.config import EngineConfig
from nonstop.engine.device import DeviceSteps
from nonstop.engine.host_memory import keep_freed_host_memory
from nonstop.engine.images import check_image_prompt
from nonstop.engine.requests import Detokenizer, Request, Resolve, Session
from nonstop.engine.sampling import SamplingParams, check_stop_ids, seed32
from nonstop.engine.scheduler import Scheduler
from nonstop.engine.types import Completion, EngineError, RequestError
from nonstop.models import Decoder, Gemma3VLM

YOUNG_GC_THRESHOLD = 20_000  # gc_heap_frozen's default first-generation threshold


@contextlib.contextmanager
def gc_heap_frozen(young_threshold: int = YOUNG_GC_THRESHOLD) -> Iterator[int]:
    """Shorter garbage-collection pauses for the engine's scheduler thread, which every
    collection stops.

    Within: the objects alive at entry (JAX's, Flax's, the model's) are out of the collector's
    sight (`gc.freeze`, after a collection), and the youngest generation is collected every
    `young_threshold` allocations (at least; CPython's default is 700), so older generations
    are collected far less often. Yields how many objects were frozen. On exit both are handed
    back, so nothing leaks; inside an already frozen heap this does nothing. `nonstop rl`,
    `nonstop agentic` and `nonstop serve` run inside it (docs/engine.md).
    """
    if young_threshold < 1:
        raise ValueError(f"gc_heap_frozen: young_threshold={young_threshold}; valid: an int >= 1")
    if gc.get_freeze_count():
        yield gc.get_freeze_count()
        return
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(young_threshold, thresholds[0]), *thresholds[1:])
    try:
        yield gc.get_freeze_count()
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamChunk:
    """What `Engine.stream` yields: the tokens recorded since the previous chunk, their
    logprobs and policy versions, and on the last chunk the finished `Completion`."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    completion: Completion | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """Totals since start: tokens, steps, requests, and traces of each jitted function (the
    sampler's, `sample_{rows}x{vocab}`, are shared by every engine in the process)."""

    prefilled_tokens: int
    generated_tokens: int
    prefill_chunks: int
    prefill_calls: int
    decode_steps: int
    decode_calls: int  # device calls (decode_steps_per_call steps each)
    dropped_tokens: int  # sampled for a request that had stopped by then (pipelining, K > 1)
    completed: int
    evictions: int
    swapped_out: int  # evicted sessions' caches copied to the host (swap_space_gib)
    swapped_in: int  # ... written back for their next turn
    swap_dropped: int  # ... dropped from the host to stay within the budget
    parked: int  # evicted sessions' caches moved into the parking cache (parked_slots)
    unparked: int  # ... moved back for their next turn
    park_dropped: int  # ... pushed out of a full parking cache
    preemptions: int  # running requests taken off their slot for blocks (paged), resumed later
    prefix_hit_tokens: int  # prompt positions found in the prefix cache (paged)
    free_blocks: int  # blocks of the paged pool free or only cached now (0 when dense)
    waiting: int
    active_slots: int
    cached_tokens: int  # KV-cache positions holding tokens (running requests, idle sessions)
    policy_version: int
    traces: dict[str, int]


class Engine:
    """Continuous batching over a `max_slots x max_len` KV cache; see the module docstring.

    Configure with an `EngineConfig`, or with its fields as keywords (`max_slots=...`), which
    override the config's. `tokenizer` (anything with `decode(ids) -> str`) enables stop strings.
    `mesh` (disaggregated mode, see `placement.py`): the engine's own devices, where its weights
    and KV cache live and onto which `update_weights` reshards; None keeps the model's placement.
    """

    def __init__(self, model: Decoder | Gemma3VLM, config: EngineConfig | None = None, *,
                 tokenizer: Detokenizer | None = None, policy_version: int = 0,
                 mesh: Mesh | None = None) -> None:
        self.config = config or EngineConfig()
        platform = (jax.local_devices()[0] if mesh is None else mesh.devices.flat[0]).platform
        if self.config.keep_host_memory and platform == "cpu":
            keep_freed_host_memory()
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        dtype = None if self.config.cache_dtype is None else jnp.dtype(self.config.cache_dtype)
        self._device = DeviceSteps(model, num_slots=self.config.max_slots,
                                   max_len=self.config.max_len, cache_dtype=dtype, mesh=mesh,
                                   steps_per_call=self.config.decode_steps_per_call,
                                   parked_slots=self.config.parked_slots,
                                   num_blocks=(self.config.num_blocks
                                               if self.config.kv_layout == "paged" else None),
                                   block_size=self.config.block_size)
        self._initial_version = policy_version
        self._scheduler: Scheduler | None = None
        self._seeds = random.Random(self.config.seed)
        self._session_ids = itertools.count()

    # ---------------------------------------------------------------- lifecycle

    def start(self, *, wait: bool = True) -> Engine:
        """Start the scheduler thread (it compiles first); `wait` blocks until it is ready."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self._device, self._device.initial_state,
                                        self._initial_version, self.config, self.tokenizer)
            self._scheduler.start()
        if wait:
            self._scheduler.ready.wait()
            if self._scheduler.startup_error is not None:
                raise EngineError("engine warm-up failed") from self._scheduler.startup_error
        return self

    def stop(self) -> None:
        """Stop the thread; requests still running or waiting end with finish reason "aborted"."""
        scheduler = self._scheduler
        if scheduler is not None and scheduler.is_alive():
            scheduler.stop()
            scheduler.join()

    close = stop

    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.is_alive()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Engine:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ---------------------------------------------------------------- requests

    async def generate(self, token_ids: Sequence[int] | np.ndarray,
                       params: SamplingParams | None = None, session: Session | None = None,
                       *, images: np.ndarray | None = None) -> Completion:
        """Generate a continuation of `token_ids` (the whole context, also in a session).

        `images`: processed images float32[I, H, W, C] for the prompt's image placeholders
        (vision-language models only; not within a session)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()

        def resolve(result: Completion | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        request = self._submit(token_ids, params, session, resolve, images)
        try:
            return await future
        except asyncio.CancelledError:
            if self._scheduler is not None:
                self._scheduler.post(("cancel", request))
            raise

    async def stream(self, token_ids: Sequence[int] | np.ndarray,
                     params: SamplingParams | None = None, session: Session | None = None
                     ) -> AsyncIterator[StreamChunk]:
        """`generate`, yielding the tokens as the device produces them: each chunk holds every
        token recorded since the previous one (one decode call's, or more if the consumer
        lags); the last chunk also carries the `Completion`. Leaving the iteration early
        (break, `aclose`, a cancelled task) cancels the request and frees its slot at once.
        With `on_weight_update="restart"` a restarted request streams again from its first
        token; the final completion is authoritative."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        request = self._request(token_ids, params, session, put)
        request.on_token = lambda token, logprob, version: put((token, logprob, version))
        self._ensure_started().post(("submit", request))
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                steps = [i for i in items if isinstance(i, tuple)]
                end = next((i for i in items if not isinstance(i, tuple)), None)
                if isinstance(end, BaseException):
                    finished = True
                    raise end
                finished = end is not None
                yield StreamChunk(tokens=tuple(t for t, _, _ in steps),
                                  logprobs=tuple(lp for _, lp, _ in steps),
                                  policy_versions=tuple(v for _, _, v in steps),
                                  completion=end)
        finally:
            if not finished and self._scheduler is not None:
                self._scheduler.post(("cancel", request))

    def submit(self, token_ids: Sequence[int] | np.ndarray, params: SamplingParams | None = None,
               session: Session | None = None, *, images: np.ndarray | None = None
               ) -> concurrent.futures.Future[Completion]:
        """Thread-safe, non-async: a `concurrent.futures.Future` of the completion."""
        future: concurrent.futures.Future[Completion] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()

        def resolve(result: Completion | BaseException) -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        self._submit(token_ids, params, session, resolve, images)
        return future

    def generate_sync(self, token_ids: Sequence[int] | np.ndarray,
                      params: SamplingParams | None = None, session: Session | None = None,
                      timeout: float | None = None, *, images: np.ndarray | None = None
                      ) -> Completion:
        """Blocking `generate`, for scripts, tests and benchmarks."""
        return self.submit(token_ids, params, session, images=images).result(timeout)

    def session(self) -> Session:
        """A new session: its turns keep their slot's KV cache (see `Session`)."""
        return Session(self._ensure_started(), next(self._session_ids))

    def _ensure_started(self) -> Scheduler:
        if self._scheduler is None:
            self.start(wait=False)
        assert self._scheduler is not None
        if not self._scheduler.is_alive() and self._scheduler.ready.is_set():
            raise EngineError("the engine is stopped")
        return self._scheduler

    def _submit(self, token_ids: Sequence[int] | np.ndarray, params: SamplingParams | None,
                session: Session | None, resolve: Resolve,
                images: np.ndarray | None = None) -> Request:
        request = self._request(token_ids, params, session, resolve)
        if images is not None:
            request.image_features = self._image_features(request.prompt, images, session)
        self._ensure_started().post(("submit", request))
        return request

    def _image_features(self, prompt: list[int], images: np.ndarray,
                        session: Session | None) -> np.ndarray:
        image_id = self._device.image_token_id
        if image_id is None:
            raise RequestError("images: this engine's model has no vision tower")
        if session is not None:
            raise RequestError("images: image prompts are not supported within a session")
        images = np.asarray(images, np.float32)
        if images.ndim != 4:
            raise RequestError(f"images: expected processed images float32[I, H, W, C], got "
                               f"shape {list(images.shape)}")
        state = (self._scheduler.state if self._scheduler is not None
                 else self._device.initial_state)
        try:
            features = self._device.encode_images(state, images)
            check_image_prompt(prompt, features, image_id, max(self.config.chunk_sizes))
        except ValueError as e:
            raise RequestError(f"images: {e}") from None
        return features

    def _request(self, token_ids: Sequence[int] | np.ndarray, params: SamplingParams | None,
                 session: Session | None, resolve: Resolve) -> Request:
        prompt = _prompt_list(token_ids, self.model_config.vocab_size, self.config.max_len)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params: got {type(params).__name__}; valid: SamplingParams")
        check_stop_ids(params.stop_token_ids, self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise RequestError(f"SamplingParams.stop {params.stop!r} needs a tokenizer to match "
                               "text: pass tokenizer= to the Engine, or use stop_token_ids")
        if session is not None:
            if not isinstance(session, Session) or session._scheduler is not self._scheduler:
                raise RequestError("session: not a session of this engine")
            if session.closed:
                raise RequestError(f"session {session.id} is closed")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Request(prompt=prompt, temperature=float(params.temperature),
                       top_k=min(params.top_k, self.model_config.vocab_size),
                       top_p=float(params.top_p), seed=seed32(seed),
                       max_tokens=params.max_tokens, stop_ids=frozenset(params.stop_token_ids),
                       stop=params.stop, session=session, resolve=resolve)

    # ---------------------------------------------------------------- weights and state

    def update_weights(self, params: nnx.State, version: int, *, copy: bool = True) -> None:
        """Use `params` (e.g. `nnx.state(model)`) from the next device step on, as `version`.

        The engine keeps references to the arrays; with `copy` (default) it keeps copies, so
        the caller may donate or overwrite its own afterwards. Shapes and dtypes must match.
        """
        self._device.check_state(params)
        params = self._device.place(params, copy=copy)
        self._ensure_started().post(("weights", params, int(version)))

    @property
    def policy_version(self) -> int:
        """The version of the weights the next device step uses."""
        s = self._scheduler
        return self._initial_version if s is None else s.version

    def stats(self) -> EngineStats:
        s = self._scheduler
        c = s.counters if s is not None else None
        return EngineStats(
            prefilled_tokens=c.prefilled_tokens if c else 0,
            generated_tokens=c.generated_tokens if c else 0,
            prefill_chunks=c.prefill_chunks if c else 0,
            prefill_calls=c.prefill_calls if c else 0,
            decode_steps=c.decode_steps if c else 0,
            decode_calls=c.decode_calls if c else 0,
            dropped_tokens=c.dropped_tokens if c else 0,
            completed=c.completed if c else 0,
            evictions=c.evictions if c else 0,
            swapped_out=c.swapped_out if c else 0,
            swapped_in=c.swapped_in if c else 0,
            swap_dropped=c.swap_dropped if c else 0,
            parked=c.parked if c else 0,
            unparked=c.unparked if c else 0,
            park_dropped=c.park_dropped if c else 0,
            preemptions=c.preemptions if c else 0,
            prefix_hit_tokens=c.prefix_hit_tokens if c else 0,
            free_blocks=s.blocks.pool.num_free if s is not None and s.blocks is not None else 0,
            waiting=len(s.waiting) + len(s.returning) if s else 0,
            active_slots=int(s.decoding.sum()) + len(s.prefilling) if s else 0,
            cached_tokens=sum(len(t) for t in list(s.slot_tokens)) if s else 0,
            policy_version=self.policy_version,
            traces=dict(self._device.traces))


def _settle(future: asyncio.Future[Completion], result: Completion | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _prompt_list(token_ids: Sequence[int] | np.ndarray, vocab_size: int, max_len: int
                 ) -> list[int]:
    """Validate a prompt and return it as a list of Python ints."""
    if isinstance(token_ids, str | bytes):
        raise RequestError("token_ids: got text; valid: a sequence of token ids (tokenize first)")
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError) as error:
        raise RequestError(f"token_ids: not a sequence of ints ({error})") from error
    if ids.size == 0:
        raise RequestError("token_ids: the prompt is empty; valid: at least one token id")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise RequestError(f"token_ids: got an array of {ids.dtype} with shape {ids.shape}; "
                           "valid: a 1-D sequence of ints")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise RequestError(f"token_ids: {bad[:8].tolist()} are outside the vocabulary "
                           f"[0, {vocab_size})")
    if ids.size >= max_len:
        raise RequestError(f"token_ids: the prompt has {ids.size} tokens but the context holds "
                           f"max_len={max_len}; valid: at most {max_len - 1} (one is generated)")
    return ids.tolist()


__all__ = ["Engine", "EngineStats", "StreamChunk"]
