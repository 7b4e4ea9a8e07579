"""How `RemoteEngine` hands a published weights blob to one rollout server: a `nonstop serve` gets
it posted (through POSIX shared memory on this host, else as the body); a vLLM server started with
`VLLM_SERVER_DEV_MODE=1` reloads it from `model.safetensors` in a weight directory, between a
pause that aborts its requests and a resume (see the `remote` module docstring)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any, Literal

import httpx

from nonstop.engine.remote_http import (
    RETRYABLE_ERRORS,
    RETRYABLE_STATUS,
    RemoteEngineError,
    Server,
    Unreachable,
    error_message,
)

WeightTransfer = Literal["auto", "http", "shm"]

_BODY_CHUNK = 4 << 20


def _body(blob: bytes) -> Iterator[memoryview]:
    """`blob` as a request body in views of at most 4 MiB. httpcore's synchronous writer keeps
    what a `send` left as `buffer[n:]`: for one bytes body that copies the rest after every send
    (quadratic: 60 s for a 1.1 GB body here), for a memoryview it copies nothing."""
    view = memoryview(blob)
    return (view[i:i + _BODY_CHUNK] for i in range(0, len(view), _BODY_CHUNK))


class WeightPusher:
    """Pushes blobs to servers (blocking; one per thread at a time per server)."""

    def __init__(self, headers: dict[str, str], timeout: httpx.Timeout,
                 transfer: WeightTransfer, weight_dir: str | os.PathLike[str] | None) -> None:
        """`transfer`: "auto" (shared memory for a server on this host), "http" or "shm".
        `weight_dir`: where vLLM servers' updates are written; None: a temporary directory,
        removed by `close`."""
        self._headers = headers
        self._timeout = timeout
        self._transfer = transfer
        self._weight_dir = None if weight_dir is None else os.fspath(weight_dir)
        self._own_weight_dir: str | None = None  # the temporary one, removed by close()
        self._written_version: int | None = None  # the version in weight_dir's file
        self._file_lock = threading.Lock()

    def close(self) -> None:
        """Remove the temporary weight directory (if this pusher made one)."""
        if self._own_weight_dir is not None:
            shutil.rmtree(self._own_weight_dir, ignore_errors=True)
            self._own_weight_dir = self._written_version = None

    def push(self, server: Server, blob: bytes, version: int) -> None:
        """Post `blob` to one server (blocking; shared memory for a server on this host when
        `weight_transfer` allows), or have a vLLM server reload it from `weight_dir`. A version
        the server has passed already is not an error."""
        if server.vllm:
            self._reload_vllm(server, blob, version)
            return
        shm = self._transfer == "shm" or (self._transfer == "auto" and server.loopback)
        url = f"{server.root}/nonstop/weights"
        segment = None
        try:
            with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
                if shm:
                    segment = shared_memory.SharedMemory(create=True, size=max(len(blob), 1))
                    segment.buf[:len(blob)] = blob
                    response = client.post(url, json={"version": version, "shm": segment.name,
                                                      "nbytes": len(blob)})
                else:
                    response = client.post(
                        url, params={"version": version}, content=_body(blob),
                        headers={"Content-Type": "application/octet-stream",
                                 "Content-Length": str(len(blob))})
        except RETRYABLE_ERRORS as error:
            raise Unreachable(f"POST {url}: {type(error).__name__}: {error}") from error
        finally:
            if segment is not None:
                segment.close()
                segment.unlink()
        if response.status_code in RETRYABLE_STATUS:
            raise Unreachable(f"POST {url} -> HTTP {response.status_code}")
        if response.status_code == 404:  # not nonstop serve: a vLLM server in dev mode?
            if self._has_vllm_dev_endpoints(server):
                server.vllm = True
                self._reload_vllm(server, blob, version)
                return
            raise takes_no_weights(server)
        if response.status_code == 409:  # it runs a newer version already
            return
        if response.status_code >= 400:
            message, body = error_message(response)
            raise RemoteEngineError(f"POST {url} -> HTTP {response.status_code}: {message}",
                                    status=response.status_code, body=body)
        server.version = version
        server.nonstop = True

    def _has_vllm_dev_endpoints(self, server: Server) -> bool:
        url = f"{server.root}/is_paused"
        try:
            with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
                return client.get(url).status_code == 200
        except RETRYABLE_ERRORS as error:
            raise Unreachable(f"GET {url}: {type(error).__name__}: {error}") from error

    def _weights_file(self, blob: bytes, version: int) -> str:
        """The directory whose `model.safetensors` holds `blob` (written once per version, and
        atomically: a server never reads half a file)."""
        with self._file_lock:
            if self._weight_dir is None and self._own_weight_dir is None:
                self._own_weight_dir = tempfile.mkdtemp(prefix="nonstop-weights-")
            directory = self._weight_dir or self._own_weight_dir
            assert directory is not None
            if self._written_version != version:
                os.makedirs(directory, exist_ok=True)
                path = os.path.join(directory, "model.safetensors")
                with open(path + ".tmp", "wb") as file:
                    file.write(blob)
                os.replace(path + ".tmp", path)
                self._written_version = version
            return directory

    def _reload_vllm(self, server: Server, blob: bytes, version: int) -> None:
        """Pause `server` (aborting what runs), reload the weights from `weight_dir`, set the
        version, resume (blocking). New requests from this client wait meanwhile."""
        directory = self._weights_file(blob, version)
        with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
            server.ready.clear()
            server.updates += 1
            try:
                self._vllm_call(client, server, "/pause", params={"mode": "abort"})
                self._vllm_call(client, server, "/collective_rpc", json={
                    "method": "reload_weights", "kwargs": {"weights_path": directory}})
                # A request sent just before the pause may have been queued (not aborted) by it:
                # abort it too, so that every request that spans the reload is resubmitted.
                self._vllm_call(client, server, "/abort_requests", json={})
                self._vllm_call(client, server, "/update_weight_version",
                                json={"new_version": str(version)})
                server.version = version
            finally:
                try:
                    self._vllm_call(client, server, "/resume")
                finally:
                    server.ready.set()

    def _vllm_call(self, client: httpx.Client, server: Server, path: str,
                   json: dict[str, Any] | None = None,
                   params: dict[str, str] | None = None) -> None:
        url = f"{server.root}{path}"
        try:
            response = client.post(url, json=json, params=params)
        except RETRYABLE_ERRORS as error:
            raise Unreachable(f"POST {url}: {type(error).__name__}: {error}") from error
        if response.status_code in RETRYABLE_STATUS:
            raise Unreachable(f"POST {url} -> HTTP {response.status_code}")
        if response.status_code == 404:
            raise RemoteEngineError(f"{server.root} has no POST {path} (HTTP 404): start vllm "
                                    "serve with VLLM_SERVER_DEV_MODE=1 to update its weights",
                                    status=404)
        if response.status_code >= 400:
            message, body = error_message(response)
            hint = (f" (weight_dir {self._weight_dir or self._own_weight_dir!r} must be readable "
                    "by the server at that path)") if path == "/collective_rpc" else ""
            raise RemoteEngineError(f"POST {url} -> HTTP {response.status_code}: {message}{hint}",
                                    status=response.status_code, body=body)


def takes_no_weights(server: Server) -> RemoteEngineError:
    return RemoteEngineError(
        f"{server.root} takes no weights: neither nonstop serve's POST /nonstop/weights nor "
        "vLLM's GET /is_paused answers (404); for vLLM, start vllm serve with "
        "VLLM_SERVER_DEV_MODE=1 (its weight-update endpoints), else use nonstop serve")
