"""HTTP rerank endpoints in the shapes search and RAG clients already send, behind the same
``CallHandler`` (so the same batcher and engine) as gRPC:

    POST /v2/rerank  Cohere v2  {model, query, documents: [str], top_n?, max_tokens_per_doc?,
                                 return_documents?} -> {id, results: [{index, relevance_score}], meta}
    POST /v1/rerank  Jina       {model, query, documents: [str | {text}], top_n?, return_documents?}
                                -> {model, usage: {total_tokens}, results: [{index, relevance_score,
                                   document: {text}}]}
    POST /rerank     TEI        {query, texts: [str], truncate?, truncation_direction?, raw_scores?,
                                 return_text?} -> [{index, score, text?}]
    GET  /health     200 while SERVING, else 503
    GET  /info       the model, template, limits, schemes and versions

A call scores as the gRPC call with ``prompt = query``, the template's default instruction and
``scheme = auto``; results come best first. ``model`` and unknown fields are accepted and ignored.
Each shape is a pydantic model and two functions: one to a ``ScoreDocsRequest``, one back from the
``ScoreDocsResponse``. The body is validated inside the handler's call, so a bad body is answered,
counted and logged like any bad call. An error is a JSON body ``{message, field, code, request_id}``
(``code`` the gRPC status name, as in the metrics) with the HTTP status of ``http_status``.
``X-Request-Id`` goes in and out; ``X-Timeout-Ms`` is the call's deadline; ``X-Prefix-Cache: off``
and ``X-Cache-Salt`` are the prefix-cache options of the gRPC call. With an API key set,
the POST routes and /info want ``Authorization: Bearer <key>`` (401 otherwise, before any work).

The body is read in pieces: refused (413) by its Content-Length before a byte of it is read, or as
soon as the bytes read pass ``--max-message-bytes``; one that does not arrive within
``--http-body-timeout-s`` is 408. A client that closes its connection before its answer cancels its
call as gRPC's cancel does (a queued call leaves the queue unscored), counted CANCELLED and logged
499.

``start_http`` serves the app with uvicorn on the running event loop (``scorer serve --http-port``),
its connections within ``http_edge``'s limits (docs/limits.md); the Ray deployment serves
``build_app`` as its Serve ingress.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from ..planning import AUTO, names
from ..request import VISIBLE, InvalidInput
from ..v1 import scorer_pb2 as pb
from .auth import ApiKeys
from .handler import (
    REQUEST_ID_KEY,
    AnswerTooLarge,
    CallHandler,
    DeadlinePassed,
    MessageTooLarge,
    Metadata,
    expired_code,
    timeout_seconds,
)
from .http_edge import MALFORMED, Edge, EdgeProtocol, HttpLimits

log = logging.getLogger(__name__)

COHERE_MAX_TOKENS_PER_DOC = 4096
"""Cohere's default ``max_tokens_per_doc``."""
UINT32_MAX = 2**32 - 1
"""The largest ``top_n`` and ``max_doc_tokens`` the call's message holds."""
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection
STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client closed the request
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
SIZE_FIELDS = re.compile(r"docs(\[\d+\](\.text)?)?|prompt|request")
"""Engine fields whose INVALID_ARGUMENT is a size (413): too many docs, a doc over its bytes or
tokens, a query that leaves no room, a call over its bytes. The shapes refuse an empty query, no
documents and an empty document (400) before the engine sees them."""


# The three shapes. Strict: a number is not a string, "3" not an int; unknown fields are ignored.


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # accepted and ignored: the served model answers


class CohereRerank(_Body):
    query: str
    documents: list[str]
    top_n: int | None = None
    max_tokens_per_doc: int | None = None
    return_documents: bool | None = None


def _jina_text(doc: Any) -> Any:
    return doc.get("text") if isinstance(doc, dict) else doc


class JinaRerank(_Body):
    query: str
    documents: list[Annotated[str, BeforeValidator(_jina_text)]]  # a string or {"text": ...}
    top_n: int | None = None
    return_documents: bool | None = None


class TeiRerank(_Body):
    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: str | None = None
    raw_scores: bool | None = None
    return_text: bool | None = None


def cohere_request(body: CohereRerank) -> pb.ScoreDocsRequest:
    max_tokens = _positive(body.max_tokens_per_doc, "max_tokens_per_doc", COHERE_MAX_TOKENS_PER_DOC)
    return _score_request(
        body.query, body.documents, "documents", "doc_end", max_tokens, _positive(body.top_n, "top_n", 0)
    )


def cohere_response(body: CohereRerank, reply: pb.ScoreDocsResponse) -> dict:
    results = [
        {"index": r.index, "relevance_score": r.score}
        | ({"document": {"text": body.documents[r.index]}} if body.return_documents else {})
        for r in _best_first(reply)
    ]
    tokens = {"input_tokens": reply.usage.prompt_tokens + reply.usage.doc_tokens, "output_tokens": 0}
    return {
        "id": reply.request_id,
        "results": results,
        "meta": {"api_version": {"version": "2"}, "tokens": tokens},
    }


def jina_request(body: JinaRerank) -> pb.ScoreDocsRequest:
    return _score_request(
        body.query, body.documents, "documents", "doc_end", 0, _positive(body.top_n, "top_n", 0)
    )


def jina_response(body: JinaRerank, reply: pb.ScoreDocsResponse) -> dict:
    documents = body.return_documents is not False  # Jina's default: true
    results = [
        {"index": r.index, "relevance_score": r.score}
        | ({"document": {"text": body.documents[r.index]}} if documents else {})
        for r in _best_first(reply)
    ]
    usage = {"total_tokens": reply.usage.prompt_tokens + reply.usage.doc_tokens}
    return {"model": reply.model, "usage": usage, "results": results}


def tei_request(body: TeiRerank) -> pb.ScoreDocsRequest:
    direction = (body.truncation_direction or "right").lower()
    if direction not in ("left", "right"):
        raise InvalidInput("truncation_direction", "expected left or right")
    if body.truncate and direction == "left":
        raise InvalidInput(
            "truncation_direction", "left (cutting a text's start) is not supported; use right"
        )
    truncate = "doc_end" if body.truncate else "error"
    request = _score_request(body.query, body.texts, "texts", truncate, 0, 0)
    request.options.return_label_logprobs = bool(body.raw_scores)
    return request


def tei_response(body: TeiRerank, reply: pb.ScoreDocsResponse) -> list[dict]:
    return [
        {"index": r.index, "score": log_odds(r.label_logprobs) if body.raw_scores else r.score}
        | ({"text": body.texts[r.index]} if body.return_text else {})
        for r in _best_first(reply)
    ]


def log_odds(label_logprobs) -> float:
    """TEI's raw score: ``lp0 - logsumexp(the other labels)`` (``lp0 - lp1`` for two), whose sigmoid
    is the softmax score P(label 0) over the labels."""
    first, *others = label_logprobs
    top = max(others)
    return first - (top + math.log(sum(math.exp(x - top) for x in others)))


@dataclass(frozen=True)
class Shape:
    api: str  # the metrics' api label
    docs: str  # the name of its documents field
    body: type[_Body]
    to_request: Callable[[Any], pb.ScoreDocsRequest]
    to_response: Callable[[Any, pb.ScoreDocsResponse], Any]


SHAPES = {
    "/v2/rerank": Shape("cohere", "documents", CohereRerank, cohere_request, cohere_response),
    "/v1/rerank": Shape("jina", "documents", JinaRerank, jina_request, jina_response),
    "/rerank": Shape("tei", "texts", TeiRerank, tei_request, tei_response),
}


def _score_request(
    query: str, docs: list[str], field: str, truncate: str, max_doc_tokens: int, top_n: int
) -> pb.ScoreDocsRequest:
    if not VISIBLE.search(query):
        raise InvalidInput("query", "empty query (only white space or control characters)")
    if not docs:
        raise InvalidInput(field, "no documents to score")
    for i, doc in enumerate(docs):
        if not VISIBLE.search(doc):
            raise InvalidInput(f"{field}[{i}]", "empty document (only white space or control characters)")
    options = pb.ScoreOptions(scheme=AUTO, truncate=truncate, max_doc_tokens=max_doc_tokens, top_n=top_n)
    return pb.ScoreDocsRequest(prompt=query, docs=[pb.Doc(text=d) for d in docs], options=options)


def _positive(value: int | None, field: str, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise InvalidInput(field, f"{value} is not a positive integer")
    if value > UINT32_MAX:
        raise InvalidInput(field, f"{value} is over {UINT32_MAX}")
    return value


def _best_first(reply: pb.ScoreDocsResponse) -> list[pb.DocScore]:
    return sorted(reply.results, key=lambda r: -r.score)  # stable: ties in input order


def _validated(shape: Shape, body: bytes) -> _Body:
    """The body as the shape's model; InvalidInput naming the first bad field (``body`` when it
    is not a JSON object)."""
    try:
        return shape.body.model_validate_json(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise InvalidInput("body", f"not JSON ({error['ctx'].get('error', error['msg'])})") from None
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        message = "required" if error["type"] == "missing" else error["msg"]
        raise InvalidInput(field or "body", message) from None


# One call through the handler.


class ClientGone(asyncio.CancelledError):
    """The client closed its connection before its answer: the call is cancelled as gRPC's cancel
    does (counted CANCELLED, logged 499)."""


class BodyTimeout(DeadlinePassed):
    """The body did not arrive within ``--http-body-timeout-s`` (408, counted DEADLINE_EXCEEDED)."""


async def read_body(request: Request, limit: int | None, timeout_s: float) -> bytes:
    """The request's body, read in pieces as it arrives: MessageTooLarge as soon as its
    Content-Length, or the bytes read, pass ``limit`` (no more is read); BodyTimeout when it is
    not complete within ``timeout_s``; ClientGone when the client closes the connection first;
    InvalidInput when bytes after it do not parse (``http_edge.MALFORMED``)."""
    length = request.headers.get("content-length", "")
    if limit is not None and length.isdigit() and int(length) > limit:
        raise MessageTooLarge(f"Content-Length {int(length)} over --max-message-bytes {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if limit is not None and len(body) > limit:
                    raise MessageTooLarge(f"over --max-message-bytes {limit} ({len(body)} bytes read)")
    except TimeoutError:
        raise BodyTimeout(f"not received within --http-body-timeout-s {timeout_s:g}") from None
    except ClientDisconnect:
        raise ClientGone() from None
    if malformed := request.scope.get(MALFORMED):
        raise InvalidInput("body", malformed)
    return bytes(body)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(call: asyncio.Task, request: Request):
    """``call``'s result; ClientGone, with ``call`` cancelled (a queued call leaves the queue
    unscored), when the client closes the connection first."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not call.done():  # the client left, or this task is cancelled (a shutdown past its grace)
            call.cancel()
    if not call.done():
        await asyncio.wait({call})  # the handler counts and logs it
        raise ClientGone()
    return call.result()


class Failed(Exception):
    """The handler's answer to a failed call, as the HTTP front raises it (gRPC's abort does too)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str, status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.field, self.status = code, message, field, status


class HttpFront:
    """One HTTP call: its request id and deadline from the headers (checked in ``check_headers``),
    the request id the handler settles on, and failures raised as ``Failed``."""

    def __init__(self, shape: Shape, headers: Mapping[str, str], default_timeout_s: float | None) -> None:
        self.shape = shape
        self.api = shape.api
        self.arrived = time.monotonic()
        self.request_id = headers.get("x-request-id", "")
        self.answer_id = ""
        self.timeout_s = default_timeout_s
        self._bad_timeout = None
        if (header := headers.get("x-timeout-ms")) is not None:
            self.timeout_s = timeout_seconds(header)
            if self.timeout_s is None:
                self._bad_timeout = header
        self.prefix_cache = headers.get("x-prefix-cache", "")
        self.cache_salt = headers.get("x-cache-salt", "")
        self._authorization = headers.get("authorization")

    def authorization(self) -> str | None:
        return self._authorization

    def check_headers(self) -> None:
        if self._bad_timeout is not None:
            raise InvalidInput(
                "X-Timeout-Ms", f"{self._bad_timeout!r} is not a positive number of milliseconds"
            )
        if self.prefix_cache.lower() not in ("", "on", "off"):
            raise InvalidInput("X-Prefix-Cache", f"{self.prefix_cache!r} is not on or off")

    def options(self, request: pb.ScoreDocsRequest) -> pb.ScoreDocsRequest:
        """``request`` with the options the headers carry."""
        request.options.prefix_cache = "off" if self.prefix_cache.lower() == "off" else ""
        request.options.cache_salt = self.cache_salt
        return request

    def deadline(self, started: float) -> float | None:
        return None if self.timeout_s is None else self.arrived + self.timeout_s

    def set_trailers(self, trailers: Metadata) -> None:
        self.answer_id = dict(trailers)[REQUEST_ID_KEY]

    def cancelled_code(self) -> grpc.StatusCode:
        return expired_code(self.deadline(self.arrived))

    async def fail(self, code, message, trailers, exc) -> pb.ScoreDocsResponse:
        raise Failed(code, *self._explain(code, message, exc)) from exc

    def _explain(self, code: grpc.StatusCode, message: str, exc: Exception) -> tuple[str, str, int]:
        """(message, field, HTTP status) in the API's terms."""
        if isinstance(exc, AnswerTooLarge):  # the request is fine; what it asks for is not
            return f"answer: {message}", "answer", 413
        if isinstance(exc, MessageTooLarge):
            return f"body: {message}", "body", 413
        if isinstance(exc, BodyTimeout):
            return f"body: {message}", "body", 408
        if not isinstance(exc, InvalidInput):
            return message, "", STATUS.get(code, 500)
        field = _http_field(exc.field, self.shape.docs)
        detail = message.removeprefix(f"{exc.field}: ")
        if self.api == "tei":
            detail = detail.replace("set truncate=doc_end", 'set "truncate": true')
        return f"{field}: {detail}", field, 413 if SIZE_FIELDS.fullmatch(exc.field) else 400


def _http_field(field: str, docs: str) -> str:
    """An engine field in the API's terms: ``docs[3].text`` -> ``documents[3]``, ``prompt`` -> ``query``."""
    if m := re.fullmatch(r"docs(\[\d+\])?(\.text)?", field):
        return docs + (m.group(1) or "")
    renamed = {
        "prompt": "query",
        "request_id": "X-Request-Id",
        "options.top_n": "top_n",
        "options.max_doc_tokens": "max_tokens_per_doc",
        "options.cache_salt": "X-Cache-Salt",
    }
    return renamed.get(field, field)


def _error(
    status: int, code: str, message: str, field: str, request_id: str = "", headers=None
) -> JSONResponse:
    body = {"message": message, "field": field, "code": code, "request_id": request_id}
    return JSONResponse(body, status, headers=headers)


def build_app(
    handler: CallHandler,
    serving: Callable[[], bool],
    api_key: ApiKeys | str | None = None,
    default_timeout_s: float | None = None,
    echo_request_id: bool = True,
    body_timeout_s: float = HttpLimits.body_timeout_s,
) -> FastAPI:
    """The routes over ``handler``; ``serving()`` answers /health; ``default_timeout_s`` is the
    deadline of a call without ``X-Timeout-Ms``; ``body_timeout_s`` the longest a body may take
    to arrive. ``echo_request_id`` False: a proxy in front writes
    the ``X-Request-Id`` answer header (Ray Serve's, which also puts its own id in the request's
    header when the client sent none, so the call, its log lines and the answer share one id)."""
    app = FastAPI(title="scorer", docs_url=None, redoc_url=None, openapi_url=None)

    def id_header(request_id: str) -> dict | None:
        return {"x-request-id": request_id} if echo_request_id and request_id else None

    keys = ApiKeys.of(api_key)

    def authorized(request: Request) -> bool:
        return keys is None or keys.allows(request.headers.get("authorization"))

    def unauthorized() -> JSONResponse:
        return _error(401, "UNAUTHENTICATED", "Authorization: Bearer <api key> required", "Authorization")

    async def rerank(shape: Shape, request: Request) -> JSONResponse:
        if not authorized(request):
            return unauthorized()
        front = HttpFront(shape, request.headers, default_timeout_s)
        unread: BaseException | None = None
        try:
            raw = await read_body(request, handler.max_message_bytes, body_timeout_s)
        except (MessageTooLarge, BodyTimeout, InvalidInput, ClientGone) as e:
            raw, unread = b"", e  # answered and counted as the call's failure, in the handler
        parsed: list[_Body] = []

        def build() -> pb.ScoreDocsRequest:
            front.check_headers()
            if unread is not None:
                raise unread
            parsed.append(_validated(shape, raw))
            return front.options(shape.to_request(parsed[0]))

        # the handler answers DEADLINE_EXCEEDED (504) once X-Timeout-Ms passes
        call = asyncio.ensure_future(handler.score_docs(build, front))
        try:
            reply = await (call if unread is not None else _unless_gone(call, request))
        except ClientGone:
            log.info(
                "%s %d: the client closed the connection",
                request.url.path,
                CLIENT_CLOSED,
                extra={"request_id": front.answer_id or "-"},
            )
            return Response(status_code=CLIENT_CLOSED)
        except Failed as f:
            headers = id_header(front.answer_id) or {}
            if unread is not None and f.status in (408, 413):  # the rest of the body is not read
                headers["connection"] = "close"
            return _error(f.status, f.code.name, f.message, f.field, front.answer_id, headers)
        return JSONResponse(shape.to_response(parsed[0], reply), headers=id_header(front.answer_id))

    for path, shape in SHAPES.items():
        app.add_api_route(path, functools.partial(rerank, shape), methods=["POST"], include_in_schema=False)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = serving()
        return JSONResponse({"status": "SERVING" if ok else "NOT_SERVING"}, 200 if ok else 503)

    @app.get("/info")
    async def info(request: Request) -> JSONResponse:
        if not authorized(request):
            return unauthorized()
        if handler.service is None:
            return _error(503, grpc.StatusCode.UNAVAILABLE.name, "the model is loading", "")
        return JSONResponse(_info(handler))

    return app


def _info(handler: CallHandler) -> dict:
    """The same in a front-end process, which has the engine's EngineInfo and no model."""
    info, limits = handler.service.info, handler.service.engine.limits
    prompting = handler.service.engine.prompting
    template = prompting.templates[prompting.default_template]
    versions = {p: _version(p) for p in ("scorer", "torch", "transformers", "fastapi", "uvicorn")}
    return {
        "model_id": info.model_name,  # TEI's names first
        "max_client_batch_size": limits.max_docs,
        # a document and its prompt share the model's positions: neither limit alone is the bound
        "max_input_length": min(limits.max_doc_tokens, limits.max_positions),
        "max_batch_tokens": info.max_batch_tokens,
        "auto_truncate": False,
        "version": versions["scorer"],
        "template": template.name,
        "default_instruction": template.default_instruction,
        "head": info.head_kind,  # lm (label tokens), or the score head of a *ForSequenceClassification
        "limits": dataclasses.asdict(limits),
        "schemes": list(names()),
        "apis": {shape.api: path for path, shape in SHAPES.items()},
        "attention_backend": info.backend,
        "device": info.device,
        "versions": versions,
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


# The standalone server: uvicorn on the running loop.


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The scorer's own signal handlers shut it down (and this server with it)."""
        yield


class HttpServer:
    """uvicorn serving the app on the running event loop."""

    def __init__(self, server: _Server, sock: socket.socket, task: asyncio.Task) -> None:
        self._server, self._task = server, task
        self.port: int = sock.getsockname()[1]

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening and close idle connections; calls in flight finish for up to ``grace_s``
        seconds, then are cancelled. Idempotent."""
        if not self._server.should_exit:
            self._server.config.timeout_graceful_shutdown = grace_s
            self._server.should_exit = True
        await asyncio.shield(self._task)


async def start_http(
    handler: CallHandler,
    serving: Callable[[], bool],
    host: str,
    port: int,
    api_key: ApiKeys | str | None = None,
    default_timeout_s: float | None = None,
    reuse_port: bool = False,
    limits: HttpLimits | None = None,
) -> HttpServer:
    """Serve the rerank routes on ``host:port`` (0: a free port, see ``.port``) on this event loop;
    raises OSError when the port cannot be bound. ``reuse_port``: beside other processes' servers on
    the same port (front-end processes). ``limits``: connections, deadlines and header sizes
    (``http_edge``)."""
    limits = limits or HttpLimits()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=reuse_port)
    config = uvicorn.Config(
        build_app(handler, serving, api_key, default_timeout_s, body_timeout_s=limits.body_timeout_s),
        http=functools.partial(EdgeProtocol, edge=Edge(limits)),
        timeout_keep_alive=limits.keep_alive_s,
        # asyncio accepts up to the backlog in one go before any connection can be closed at the cap
        backlog=min(2048, limits.max_connections),
        log_config=None,
        log_level=None,
        access_log=False,
        lifespan="off",
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.005)
    return HttpServer(server, sock, task)
