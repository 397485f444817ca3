"""One ScoreDocs call from any front end: the only place where a call is opened, answered,
counted and logged, and where exceptions become status codes.

A front end (the gRPC servicer, the Ray deployment, the HTTP rerank routes of ``http.py``) wraps
its transport in a ``Front`` (deadline, trailers, how a failure is answered, its ``api`` label) and
hands each call to ``CallHandler.score_docs``: it opens a ``Call`` (request id for the logs,
in-flight count), converts the proto, tokenizes, scores through the batcher and converts back;
whatever is raised is answered with one status (INVALID_ARGUMENT naming the field,
RESOURCE_EXHAUSTED for over-capacity, UNAVAILABLE while loading or draining, INTERNAL only for
real faults, logged with the traceback), and the server keeps serving.

A call's deadline is the front's: gRPC's own, the ``x-timeout-ms`` metadata (the client's
remaining time in milliseconds, which Ray's proxy passes on where it drops the deadline), the
earlier of the two when both are set. The handler answers DEADLINE_EXCEEDED when it passes,
wherever the call waits; a call still queued then is dropped before its forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from .. import metrics
from ..request import InvalidInput
from ..v1 import scorer_pb2 as pb
from .batcher import DEADLINE_SLACK_S, Closed, Dropped, OutOfMemory, QueueFull
from .calls import Inflight, close_call, open_call
from .convert import request_from_proto, response_to_proto
from .scoring import ScoringService

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
INVALID_FIELD_KEY = "x-invalid-field"
TIMEOUT_KEY = "x-timeout-ms"
SCORE_METHOD = "/scorer.v1.Scorer/ScoreDocs"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
Metadata = tuple[tuple[str, str], ...]


class NotReady(Exception):
    """The model is still loading or warming up."""


class MessageTooLarge(Exception):
    """A request over ``--max-message-bytes``."""


class DeadlinePassed(Exception):
    """The call's deadline passed before its answer."""


DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?")


def timeout_seconds(ms: str) -> float | None:
    """An ``x-timeout-ms`` value in seconds; None when it is not a positive plain decimal number of
    milliseconds (``float`` alone would take ``1_000``, `` 100 ``, ``1e3`` and ``nan``)."""
    if not DECIMAL.fullmatch(ms):
        return None
    value = float(ms)
    return value / 1e3 if 0 < value < math.inf else None


def sent_timeout(metadata: Sequence[tuple[str, str | bytes]]) -> float | None:
    """The ``x-timeout-ms`` of gRPC metadata in seconds, None when absent; InvalidInput when bad."""
    value = next((v for k, v in metadata if k == TIMEOUT_KEY), None)
    if value is None:
        return None
    seconds = timeout_seconds(value) if isinstance(value, str) else None
    if seconds is None:
        raise InvalidInput(TIMEOUT_KEY, f"{value!r} is not a positive number of milliseconds")
    return seconds


def earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


def expired_code(deadline: float | None) -> grpc.StatusCode:
    """The code of a call cancelled under the handler: DEADLINE_EXCEEDED once ``deadline`` passed,
    within ``DEADLINE_SLACK_S`` (the client's deadline runs ahead of the server's), else CANCELLED."""
    expired = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str, Metadata]:
    """The status code, details and extra trailing metadata that answer ``exc``."""
    if isinstance(exc, InvalidInput):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ((INVALID_FIELD_KEY, exc.field),)
    if isinstance(exc, QueueFull | OutOfMemory | MessageTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or type(exc).__name__, ()
    if isinstance(exc, Dropped):
        code = grpc.StatusCode.CANCELLED if exc.reason == "cancelled" else grpc.StatusCode.DEADLINE_EXCEEDED
        return code, str(exc), ()
    if isinstance(exc, DeadlinePassed):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), ()
    if isinstance(exc, NotReady | Closed):
        return grpc.StatusCode.UNAVAILABLE, str(exc), ()
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log", ()


class Front(Protocol):
    """What the handler needs of a transport."""

    api: str
    """The ``api`` label of the call's metrics (``metrics.APIS``)."""
    request_id: str
    """A request id the transport carries beside the message (HTTP's ``X-Request-Id``), checked
    before the message is read; "" when none."""

    def deadline(self, started: float) -> float | None:
        """The call's deadline on ``time.monotonic``'s clock, or None; asked once, first thing (a
        bad ``x-timeout-ms`` raises InvalidInput)."""

    def set_trailers(self, trailers: Metadata) -> None: ...

    def cancelled_code(self) -> grpc.StatusCode:
        """The code of a call cancelled under the handler: its deadline passed, or the client left."""

    async def fail(
        self, code: grpc.StatusCode, message: str, trailers: Metadata, exc: Exception
    ) -> pb.ScoreDocsResponse:
        """Answer the call with ``code``; may raise (gRPC's abort does)."""


class GrpcFront:
    api = "grpc"
    request_id = ""  # in the message

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.arrived = time.monotonic()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else self.arrived + remaining

    def deadline(self, started: float) -> float | None:
        sent = sent_timeout(self.context.invocation_metadata() or ())
        self._deadline = earliest(self._deadline, None if sent is None else self.arrived + sent)
        return self._deadline

    def set_trailers(self, trailers: Metadata) -> None:
        self.context.set_trailing_metadata(trailers)

    def cancelled_code(self) -> grpc.StatusCode:
        """By the deadline read when the call arrived (once gRPC has cancelled a call whose
        deadline passed, the context no longer tells)."""
        return expired_code(self._deadline)

    async def fail(self, code, message, trailers, exc) -> pb.ScoreDocsResponse:
        await self.context.abort(code, message, trailing_metadata=trailers)
        raise AssertionError("abort returned")  # pragma: no cover


class CallHandler:
    """``service`` is None until the model is loaded (calls get UNAVAILABLE); ``max_message_bytes``
    bounds a request that arrives as bytes (gRPC's own limit is set above it, so that an oversize
    call is answered and counted here)."""

    def __init__(self, inflight: Inflight | None = None, max_message_bytes: int | None = None) -> None:
        self.inflight = inflight or Inflight()
        self.max_message_bytes = max_message_bytes
        self.service: ScoringService | None = None

    async def score_docs(
        self, request: bytes | pb.ScoreDocsRequest | Callable[[], pb.ScoreDocsRequest], front: Front
    ) -> pb.ScoreDocsResponse:
        """One call; ``request`` as its bytes (parsed here, so garbage is INVALID_ARGUMENT and
        counted), parsed already (Ray's proxy parses), or a function that builds it (HTTP: it
        validates the body and raises InvalidInput naming the field, answered and counted here)."""
        call, token = open_call(SCORE_METHOD, "")  # a generated id until the call's own is checked
        trailers = ((REQUEST_ID_KEY, call.request_id),)
        code, message = grpc.StatusCode.OK, ""
        self.inflight.enter()
        try:
            front.set_trailers(trailers)
            if front.request_id:
                trailers = _adopt_request_id(front.request_id, call, front)
            deadline = front.deadline(call.started)
            request = self._parse(request)
            if request.request_id:
                trailers = _adopt_request_id(request.request_id, call, front)
            return await self._score_by(deadline, request, call)
        except asyncio.CancelledError:
            code = front.cancelled_code()
            raise
        except Exception as exc:
            code, message, extra = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", SCORE_METHOD)
            return await front.fail(code, message, trailers + extra, exc)
        finally:
            seconds = time.monotonic() - call.started
            self.inflight.leave()
            metrics.observe_request(front.api, call.scheme, code.name, seconds)
            log.info(
                "%s %s scheme=%s %.1f ms%s",
                SCORE_METHOD,
                code.name,
                call.scheme,
                seconds * 1e3,
                f": {message}" if message else "",
            )
            close_call(token)

    def _parse(self, request) -> pb.ScoreDocsRequest:
        if callable(request):
            return request()
        if not isinstance(request, bytes):
            return request
        if self.max_message_bytes is not None and len(request) > self.max_message_bytes:
            limit = self.max_message_bytes
            raise MessageTooLarge(f"request of {len(request)} bytes over --max-message-bytes {limit}")
        try:
            return pb.ScoreDocsRequest.FromString(request)
        except DecodeError as e:
            raise InvalidInput("request", f"not a ScoreDocsRequest message ({e})") from None

    async def _score_by(
        self, deadline: float | None, request: pb.ScoreDocsRequest, call
    ) -> pb.ScoreDocsResponse:
        """``_score``, cancelled when ``deadline`` passes (a queued call leaves the queue unscored)."""
        timeout = asyncio.timeout(None if deadline is None else deadline - time.monotonic())
        try:
            async with timeout:
                return await self._score(request, call, deadline)
        except TimeoutError:
            if timeout.expired():
                raise DeadlinePassed("the call's deadline passed before its answer") from None
            raise

    async def _score(
        self, request: pb.ScoreDocsRequest, call, deadline: float | None
    ) -> pb.ScoreDocsResponse:
        service = self.service
        if service is None:
            raise NotReady("the model is loading")
        job, tokenize_seconds = await service.tokenize(request_from_proto(request, call.request_id))
        call.scheme = job.scheme.name
        scored = await service.score(job, deadline, call.request_id)
        return response_to_proto(
            job,
            call.request_id,
            service.engine.model_name,
            scored,
            tokenize_seconds,
            time.monotonic() - call.started,
        )


def _adopt_request_id(request_id: str, call, front: Front) -> Metadata:
    """The caller's request id for the call, its logs and its answer; raises InvalidInput on a bad one."""
    if not REQUEST_ID.fullmatch(request_id):
        raise InvalidInput("request_id", "at most 128 characters of A-Z a-z 0-9 . _ : -")
    call.request_id = request_id
    trailers = ((REQUEST_ID_KEY, call.request_id),)
    front.set_trailers(trailers)
    return trailers
