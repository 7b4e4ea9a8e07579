"""RemoteEngine over several servers: load-aware routing, session affinity, failover to another
server when one dies, and a down server taken back after `revive_after_s`.

The servers are httpx mock transports answering as `nonstop serve` does (GET /nonstop/state,
POST /v1/completions with nonstop's extensions), so these tests pin the client's routing rules
without compiling a model; tests/engine/test_remote.py and tests/engine/test_protocol.py drive
real servers.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from nonstop.engine.remote import RemoteEngine, RemoteEngineError
from nonstop.engine.sampling import SamplingParams

URLS = ["http://a.test:1", "http://b.test:2"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


class FakeServers:
    """Two (or more) fake nonstop servers behind one transport, keyed by host."""

    def __init__(self, slots: dict[str, int] | None = None):
        self.slots = slots or {}
        self.down: set[str] = set()
        self.completions: list[tuple[str, dict]] = []
        self.deleted: list[tuple[str, str]] = []
        self.hold: asyncio.Event | None = None
        self.probes: Counter[str] = Counter()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused (server down)", request=request)
        path = request.url.path
        if path == "/nonstop/state":
            self.probes[host] += 1
            return httpx.Response(200, json={
                "policy_version": 0, "paused": False, "running": 0, "waiting": 0,
                "max_slots": self.slots.get(host, 4), "max_len": 64, "sessions": 0,
                "model": "m"})
        if request.method == "DELETE" and path.startswith("/nonstop/sessions/"):
            self.deleted.append((host, path.rsplit("/", 1)[1]))
            return httpx.Response(200, json={})
        assert path == "/v1/completions", path
        body = json.loads(request.content)
        self.completions.append((host, body))
        if self.hold is not None:
            await self.hold.wait()
        n = len(body["prompt"])
        return httpx.Response(200, json={"choices": [{
            "index": 0, "text": "", "finish_reason": "length", "token_ids": [n, n + 1],
            "logprobs": {"token_logprobs": [-0.5, -0.25]}, "policy_versions": [0, 0]}]})


async def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for `condition()`; a test whose requests never arrive fails instead of hanging."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def engine(servers: FakeServers, **kwargs) -> RemoteEngine:
    kwargs.setdefault("retry_backoff_s", 0.01)
    return RemoteEngine(URLS, transport=httpx.MockTransport(servers.handler), max_len=64,
                        **kwargs)


def test_requests_go_to_the_least_loaded_server_and_wait_for_its_slots():
    """Eight requests at once to servers with 3 and 1 slots: 3 go to a, 1 to b, and the other
    four wait in the client until a slot frees (a nonstop server is never sent more than its
    slots); every request completes."""
    servers = FakeServers(slots={"a.test": 3, "b.test": 1})

    async def main() -> None:
        async with engine(servers) as remote:
            for batch in (2, 8):  # the first two probe both servers (slots unknown till then)
                servers.completions.clear()
                servers.hold = asyncio.Event()
                tasks = [asyncio.create_task(remote.generate([1, 2], PARAMS))
                         for _ in range(batch)]
                sent = min(batch, 4)
                await until(lambda: len(servers.completions) >= sent)  # noqa: B023
                if batch == 8:
                    await asyncio.sleep(0.05)  # time for a fifth request to go out, were it sent
                    assert Counter(host for host, _ in servers.completions) == {"a.test": 3,
                                                                                "b.test": 1}
                    assert remote.stats().waiting == 4
                    assert remote.stats().active_slots == 4
                servers.hold.set()
                out = await asyncio.gather(*tasks)
            assert set(servers.probes) == {"a.test", "b.test"}
            assert remote.config.max_slots == 4
            assert remote.stats().waiting == 0
        assert all(c.tokens == (2, 3) for c in out)

    asyncio.run(main())
    assert len(servers.completions) == 8


def test_a_sessions_turns_stay_on_one_server_and_close_there():
    servers = FakeServers()

    async def main() -> None:
        async with engine(servers) as remote:
            one, two = remote.session(), remote.session()
            for turn in range(3):
                servers.hold = asyncio.Event() if turn == 0 else None  # both first turns at once
                tasks = [asyncio.create_task(remote.generate([k] * (turn + 1), PARAMS, session=s))
                         for k, s in ((1, one), (2, two))]
                if turn == 0:
                    await until(lambda: len(servers.completions) >= 2)
                if servers.hold is not None:
                    servers.hold.set()
                await asyncio.gather(*tasks)
            one.close()
            two.close()

    asyncio.run(main())
    by_session: dict[str, set[str]] = {}
    for host, body in servers.completions:
        by_session.setdefault(body["session_id"], set()).add(host)
    assert len(by_session) == 2 and all(len(h) == 1 for h in by_session.values())
    # Two sessions started at once go to different servers (the second finds a busier).
    assert {h for hosts in by_session.values() for h in hosts} == {"a.test", "b.test"}
    assert sorted(servers.deleted) == sorted((next(iter(h)), s) for s, h in by_session.items())


def test_a_dead_server_is_skipped_and_its_requests_rerouted():
    """b dies while a request waits on it: that request and every later one go to a, with the
    same body (seed included); nothing fails."""
    servers = FakeServers()
    seeded = SamplingParams(temperature=1.0, max_tokens=2, seed=7)

    async def main() -> None:
        async with engine(servers, revive_after_s=3600) as remote:
            await asyncio.gather(*(remote.generate([3], seeded) for _ in range(2)))  # a and b
            servers.down.add("b.test")
            out = await asyncio.gather(*(remote.generate([4, 5], seeded) for _ in range(6)))
            stats = remote.stats()
        assert all(c.tokens == (2, 3) for c in out)
        assert stats.failed == 0 and stats.completed == 8
        assert stats.server_failures == 1 and stats.servers_up == 1 and stats.rerouted >= 1

    asyncio.run(main())
    after = [(h, b) for h, b in servers.completions if b["prompt"] == [4, 5]]
    assert {h for h, _ in after} == {"a.test"} and len(after) == 6
    assert all(b["seed"] == 7 for _, b in after)


def test_a_server_back_after_revive_after_s_gets_requests_again():
    servers = FakeServers()

    async def main() -> None:
        async with engine(servers, revive_after_s=0.2) as remote:
            servers.down.add("b.test")
            for _ in range(4):
                await remote.generate([1], PARAMS)
            servers.down.clear()
            await asyncio.sleep(0.3)
            await asyncio.gather(*(remote.generate([9], PARAMS) for _ in range(4)))
            assert remote.stats().servers_up == 2

    asyncio.run(main())
    late = Counter(h for h, b in servers.completions if b["prompt"] == [9])
    assert late["b.test"] >= 1 and servers.probes["b.test"] == 1


def test_every_server_down_is_a_clear_error_after_the_retries():
    servers = FakeServers()
    servers.down.update({"a.test", "b.test"})

    async def main() -> None:
        async with engine(servers, max_retries=1) as remote:
            with pytest.raises(RemoteEngineError, match="failed after 3 attempts"):
                await remote.generate([1], PARAMS)
            assert remote.stats().failed == 1

    asyncio.run(main())


def test_update_weights_needs_the_policy():
    with pytest.raises(Exception, match="policy="):
        RemoteEngine(URLS).update_weights(None, 1)  # type: ignore[arg-type]
