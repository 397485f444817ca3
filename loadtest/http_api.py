"""HTTP mode: the same request sets, schedules, deadlines and reports as gRPC, sent to one of the
server's rerank shapes (scorer/server/http.py) over HTTP/1.1 keep-alive connections.

    cohere  POST /v2/rerank  {query, documents: [str], top_n?, max_tokens_per_doc?}
    jina    POST /v1/rerank  {query, documents: [str], top_n?, return_documents: false}
    tei     POST /rerank     {query, texts: [str], truncate?}

A ScoreDocsRequest maps as ``prompt`` -> ``query``, the docs' text -> ``documents`` / ``texts``,
``options.top_n`` -> ``top_n`` (not TEI's), ``options.max_doc_tokens`` -> Cohere's
``max_tokens_per_doc`` and ``options.truncate=doc_end`` -> TEI's ``truncate: true``;
``request_id`` goes in ``X-Request-Id`` and the deadline in ``X-Timeout-Ms``. Token ids cannot be
sent (``check_text``); what else the body cannot carry is named by ``dropped``. The HTTP calls run
as ``scheme=auto`` with the template's default instruction, and their answers carry no scheme.

An answer is counted by the gRPC code name of the JSON error body's ``code`` (what the server's
metrics count), else by its HTTP status (``status_code``); no answer within the deadline (plus
``GRACE_S`` for the server's 504 to arrive), or an OK one after it, is DEADLINE_EXCEEDED as the
gRPC client's deadline would make it; a connection that fails is UNAVAILABLE.

The client is aiohttp where it is installed (about 0.15 ms of CPU per call), else httpx (about 1 to
2 ms, and more with many connections): ``--http-client`` picks one. Either keeps a pool of keep-alive
connections, one per call in flight (HTTP/1.1 has no multiplexing): ``--concurrency`` of them in
closed loop, up to ``--max-in-flight`` (and the open-file limit) in open loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import resource
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from scorer.v1 import scorer_pb2

from .driver import Call, DriveConfig, Driver

GRACE_S = 0.25
"""How long past its deadline a call waits for the server's own 504 before giving up on it."""
KEEPALIVE_S = 4.0
"""Idle connections are closed after this (uvicorn closes them after 5 s)."""
CLIENTS = ("aiohttp", "httpx")
GRPC_CODES = frozenset(c.name for c in grpc.StatusCode)
HTTP_STATUS = {
    200: "OK",
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    413: "INVALID_ARGUMENT",  # a size; the body says RESOURCE_EXHAUSTED where it is one
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
"""A status's gRPC code when the body names none (the inverse of the server's table); else UNKNOWN."""


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    docs: str  # the name of its documents field


APIS = {
    "cohere": Api("cohere", "/v2/rerank", "documents"),
    "jina": Api("jina", "/v1/rerank", "documents"),
    "tei": Api("tei", "/rerank", "texts"),
}


@dataclass(frozen=True)
class HttpCall(Call):
    request_id: str = ""


def body(api: str, req: scorer_pb2.ScoreDocsRequest) -> dict:
    """The JSON body of ``req`` in ``api``'s shape (the fields ``dropped`` does not name)."""
    o = req.options
    out: dict = {"query": req.prompt, APIS[api].docs: [d.text for d in req.docs]}
    if api == "tei":
        if o.truncate == "doc_end":
            out["truncate"] = True
        return out
    if o.top_n:
        out["top_n"] = o.top_n
    if api == "cohere" and o.max_doc_tokens:
        out["max_tokens_per_doc"] = o.max_doc_tokens
    if api == "jina":
        out["return_documents"] = False  # Jina's default is true; gRPC and the others send no text back
    return out


def dropped(api: str, req: scorer_pb2.ScoreDocsRequest) -> list[str]:
    """The fields of ``req`` that ``api``'s body cannot carry (the call runs without them)."""
    out = [f.name for f, _ in req.ListFields() if f.name not in ("prompt", "docs", "request_id", "options")]
    for f, value in req.options.ListFields():
        carried = (
            (f.name == "scheme" and value == "auto")
            or (f.name == "top_n" and api != "tei")
            or (f.name == "max_doc_tokens" and api == "cohere")
            or (f.name == "truncate" and (api == "tei" or value == "doc_end"))
        )
        if not carried:
            out.append(f"options.{f.name}")
    return out


def check_text(requests: Sequence[scorer_pb2.ScoreDocsRequest], api: str) -> dict[str, int]:
    """ValueError when a request carries token ids (the rerank shapes take text only); else the
    fields the API cannot carry, each with the number of requests that set it."""
    with_ids = [i for i, r in enumerate(requests) if r.prompt_token_ids or any(d.token_ids for d in r.docs)]
    if with_ids:
        first = requests[with_ids[0]]
        raise ValueError(
            f"{len(with_ids)} of {len(requests)} requests carry token ids (prompt_token_ids or docs' "
            f"token_ids; the first is request {with_ids[0] + 1}, {first.request_id or 'without an id'}), "
            f"and --api {api} cannot send them: its POST {APIS[api].path} body takes text only. "
            "Generate the set without --token-ids (loadtest.gen), or run it with --api grpc"
        )
    return dict(Counter(name for r in requests for name in dropped(api, r)))


def compile_calls(requests: Sequence[scorer_pb2.ScoreDocsRequest], api: str) -> list[HttpCall]:
    """Serialize each body once. Every HTTP call runs as scheme auto (the shapes have no scheme)."""
    check_text(requests, api)
    return [
        HttpCall(
            json.dumps(body(api, r), ensure_ascii=False, separators=(",", ":")).encode(),
            "auto",
            len(r.docs),
            r.request_id,
        )
        for r in requests
    ]


def status_code(status: int, answer: bytes) -> tuple[str, str]:
    """(gRPC code name, message) of an HTTP answer: the JSON error body's ``code`` where it names a
    gRPC code, else the status's (``HTTP_STATUS``, UNKNOWN for any other)."""
    if status == 200:
        return "OK", ""
    code, message = None, ""
    try:
        error = json.loads(answer)
        if isinstance(error, dict):
            code, message = error.get("code"), str(error.get("message") or "")
    except ValueError:
        message = answer[:200].decode(errors="replace").strip()
    if code not in GRPC_CODES or code == "OK":
        code = HTTP_STATUS.get(status, "UNKNOWN")
    return code, f"HTTP {status}" + (f": {message}" if message else "")


def base_url(target: str) -> str:
    """``host:port`` -> ``http://host:port``; a URL (``http://`` or ``https://``) as it is."""
    target = target.rstrip("/")
    return target if target.startswith(("http://", "https://")) else f"http://{target}"


def resolve_client(name: str = "") -> str:
    if name and name not in CLIENTS:
        raise ValueError(f"HTTP client must be one of {', '.join(CLIENTS)}, not {name!r}")
    if name:
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--http-client {name}: {name} is not installed")
        return name
    return "aiohttp" if importlib.util.find_spec("aiohttp") is not None else "httpx"


def pool_size(cfg: DriveConfig) -> int:
    """Connections the pool may hold: one per call in flight, within the open-file limit."""
    want = cfg.concurrency if cfg.concurrency > 0 else cfg.max_in_flight
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, want if soft == resource.RLIM_INFINITY else min(want, soft - 64))


# The two clients, behind the same three calls.


class _Aiohttp:
    def __init__(self, limit: int) -> None:
        import aiohttp

        self.errors = (aiohttp.ClientError, OSError)
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
        )

    async def post(self, url: str, payload: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        async with self.session.post(url, data=payload, headers=headers) as r:
            return r.status, await r.read()

    async def get(self, url: str) -> tuple[int, bytes]:
        async with self.session.get(url) as r:
            return r.status, await r.read()

    async def close(self) -> None:
        await self.session.close()


class _Httpx:
    def __init__(self, limit: int) -> None:
        import httpx

        self.errors = (httpx.TransportError, OSError)
        limits = httpx.Limits(
            max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=KEEPALIVE_S
        )
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None), trust_env=False)

    async def post(self, url: str, payload: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        r = await self.client.post(url, content=payload, headers=headers)
        return r.status_code, r.content

    async def get(self, url: str) -> tuple[int, bytes]:
        r = await self.client.get(url)
        return r.status_code, r.content

    async def close(self) -> None:
        await self.client.aclose()


class HttpDriver(Driver):
    """The gRPC driver's schedules and records, its calls sent as HTTP POSTs."""

    def __init__(self, cfg: DriveConfig, calls: Sequence[HttpCall]) -> None:
        super().__init__(cfg, calls)
        if cfg.api not in APIS:
            raise ValueError(f"not an HTTP api: {cfg.api!r}")
        if not all(isinstance(c, HttpCall) for c in calls):
            raise ValueError("HTTP calls come from http_api.compile_calls")
        self.base = base_url(cfg.target)
        self.url = self.base + APIS[cfg.api].path
        self.client_name = resolve_client(cfg.http_client)
        common = {"content-type": "application/json", "x-timeout-ms": f"{cfg.deadline_s * 1e3:g}"}
        if cfg.api_key:
            common["authorization"] = f"Bearer {cfg.api_key}"
        by_id: dict[str, dict[str, str]] = {}
        self.headers = [
            by_id.setdefault(
                c.request_id, {**common, "x-request-id": c.request_id} if c.request_id else common
            )
            for c in calls
        ]
        self.give_up_s = cfg.deadline_s + GRACE_S

    async def _connect(self) -> None:
        cls = _Aiohttp if self.client_name == "aiohttp" else _Httpx
        self.client = cls(pool_size(self.cfg))
        last = "no answer"
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                while True:
                    try:
                        status, answer = await self.client.get(self.base + "/health")
                        if status == 200 or status in (404, 405):  # SERVING, or no /health to ask
                            break
                        last = f"HTTP {status} {answer[:100].decode(errors='replace')}"
                    except self.client.errors as e:
                        last = f"{type(e).__name__}: {e}"
                    await asyncio.sleep(0.1)
                # open the connections the first calls will use: --concurrency, or --channels
                warm = min(max(self.cfg.concurrency, self.cfg.channels), pool_size(self.cfg))
                warming = (self.client.get(self.base + "/health") for _ in range(warm - 1))
                await asyncio.gather(*warming, return_exceptions=True)
        except TimeoutError as e:
            await self.client.close()
            raise ConnectionError(
                f"{self.base}/health not 200 within {self.cfg.connect_timeout_s:g} s (last: {last})"
            ) from e

    async def _disconnect(self) -> None:
        await self.client.close()

    async def _call(self, idx: int, due: float) -> None:
        k = idx % len(self.calls)
        c = self.calls[k]
        self.inflight += 1
        self.sent += 1
        sent = self.loop.time()
        try:
            async with asyncio.timeout(self.give_up_s):
                status, answer = await self.client.post(self.url, c.payload, self.headers[k])
            code, detail = status_code(status, answer)
        except TimeoutError:
            code, detail = (
                "DEADLINE_EXCEEDED",
                f"no answer within the {self.cfg.deadline_s * 1e3:g} ms deadline",
            )
        except self.client.errors as e:
            code, detail = "UNAVAILABLE", f"{type(e).__name__}: {e}"
        except Exception as e:  # a call must be counted whatever happened to it
            code, detail = "UNKNOWN", f"{type(e).__name__}: {e}"
        end = self.loop.time()
        if code == "OK" and end - sent > self.cfg.deadline_s:
            code, detail = "DEADLINE_EXCEEDED", "HTTP 200 after the deadline"
        if code != "OK":
            self.errors += 1
            self.s.error_examples.setdefault(code, detail)
        self._settle(c, due, sent, end, code, "")  # the rerank answers do not say which scheme ran
