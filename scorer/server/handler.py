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
from ..request import InvalidInput, check_cache_salt
from ..v1 import scorer_pb2 as pb
from . import wire
from .auth import AUTHORIZATION, ApiKeys, Unauthenticated, key_salt, load_keys
from .batcher import DEADLINE_SLACK_S, Closed, Dropped, OutOfMemory, QueueFull
from .calls import Inflight, close_call, open_call
from .convert import Counts, answer_bytes, check_counts, request_from_proto, response_to_proto
from .scoring import ScoringService

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
INVALID_FIELD_KEY = "x-invalid-field"
TIMEOUT_KEY = "x-timeout-ms"
SCORE_METHOD = "/scorer.v1.Scorer/ScoreDocs"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SCAN_ABOVE = 1 << 20
"""A message over this many bytes is held to the limits by its wire form before it is parsed
(``wire.counts``, on a thread): protobuf's parser holds the interpreter lock, and so the event
loop, ~4 ms a MiB on a 2-core VM."""
Metadata = tuple[tuple[str, str], ...]


class NotReady(Exception):
    """The model is still loading or warming up."""


class MessageTooLarge(Exception):
    """A request, or the answer it asks for, over ``--max-message-bytes``."""


class AnswerTooLarge(MessageTooLarge):
    """The answer a call asks for over ``--max-message-bytes`` (estimated before any work, or measured)."""


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
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc), ()
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

    def authorization(self) -> str | None:
        """The call's ``Authorization`` value (``Bearer KEY``), None when it sent none; asked only
        where the server has API keys."""

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

    def authorization(self) -> str | None:
        return next((v for k, v in self.context.invocation_metadata() or () if k == AUTHORIZATION), None)

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
    call is answered and counted here) and the answer. ``keys``: a call must carry one (else
    UNAUTHENTICATED, before its message is read); ``cache_salt_from_key``: its prefix-cache salt
    is derived from the key (``auth.key_salt``); ``require_cache_salt``: a call without a salt is
    refused."""

    def __init__(
        self,
        inflight: Inflight | None = None,
        max_message_bytes: int | None = None,
        keys: ApiKeys | None = None,
        cache_salt_from_key: bool = False,
        require_cache_salt: bool = False,
    ) -> None:
        self.inflight = inflight or Inflight()
        self.max_message_bytes = max_message_bytes
        self.keys = keys
        self.cache_salt_from_key = cache_salt_from_key and keys is not None
        self.require_cache_salt = require_cache_salt
        self.service: ScoringService | None = None

    @classmethod
    def from_settings(cls, settings) -> CallHandler:
        """The handler of ``scorer serve`` (one process, or each front end)."""
        return cls(
            max_message_bytes=settings.max_message_bytes,
            keys=load_keys(settings.api_key, settings.api_key_file),
            cache_salt_from_key=settings.cache_salt_from_key,
            require_cache_salt=settings.require_cache_salt,
        )

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
            key = self.keys.match(front.authorization()) if self.keys is not None else ""
            if front.request_id:
                trailers = _adopt_request_id(front.request_id, call, front)
            deadline = front.deadline(call.started)
            request = await self._parse(request)
            if request.request_id:
                trailers = _adopt_request_id(request.request_id, call, front)
            self._salt(request, key)
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
            # counted before it leaves the in-flight gauge: gRPC's abort answers the client before
            # this runs, so a reader that sees no call in flight sees every answered call's count
            metrics.observe_request(front.api, call.scheme, code.name, seconds)
            self.inflight.leave()
            log.info(
                "%s %s scheme=%s %.1f ms%s",
                SCORE_METHOD,
                code.name,
                call.scheme,
                seconds * 1e3,
                f": {message}" if message else "",
            )
            close_call(token)

    async def _parse(self, request) -> pb.ScoreDocsRequest:
        if callable(request):
            return request()
        if not isinstance(request, bytes):
            return request
        if self.max_message_bytes is not None and len(request) > self.max_message_bytes:
            limit = self.max_message_bytes
            raise MessageTooLarge(f"request of {len(request)} bytes over --max-message-bytes {limit}")
        if len(request) > SCAN_ABOVE and self.service is not None:
            # on a thread: numpy counts the ids without the interpreter lock, the loop answers meanwhile
            counts = await asyncio.to_thread(wire.counts, request, self.service.engine.limits.max_docs)
            if counts is not None:
                self._check(counts, self.service)
        try:
            return pb.ScoreDocsRequest.FromString(request)
        except DecodeError as e:
            raise InvalidInput("request", f"not a ScoreDocsRequest message ({e})") from None

    def _salt(self, request: pb.ScoreDocsRequest, key: str) -> None:
        """The prefix-cache salt the server's options make of the call's own."""
        salt = request.options.cache_salt
        if self.require_cache_salt and not salt:
            raise InvalidInput("options.cache_salt", "required by this server (--require-cache-salt)")
        if self.cache_salt_from_key:
            check_cache_salt(salt)  # before it is hashed away
            request.options.cache_salt = key_salt(key, salt)

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
        self._check(Counts.of(request), service)
        job, tokenize_seconds = await service.tokenize(request_from_proto(request, call.request_id))
        call.scheme = job.scheme.name
        scored = await service.score(job, deadline, call.request_id)
        response = response_to_proto(
            job,
            call.request_id,
            service.engine.model_name,
            scored,
            tokenize_seconds,
            time.monotonic() - call.started,
        )
        # gRPC would refuse to send it (the client gets RESOURCE_EXHAUSTED): answered and counted so here
        self._check_answer(response.ByteSize(), "takes")
        return response

    def _check(self, counts: Counts, service: ScoringService) -> None:
        """The limits, before the message is copied; the answer's size, before any compute."""
        check_counts(counts, service.engine.limits)
        self._check_answer(answer_bytes(counts), "would take up to")

    def _check_answer(self, size: int, verb: str) -> None:
        limit = self.max_message_bytes
        if limit is not None and size > limit:
            raise AnswerTooLarge(
                f"the answer {verb} {size} bytes, over --max-message-bytes {limit}: ask for fewer docs"
                " (top_n), labels or label log-probs, or shorter doc ids"
            )


def _adopt_request_id(request_id: str, call, front: Front) -> Metadata:
    """The caller's request id for the call, its logs and its answer; raises InvalidInput on a bad one."""
    if not REQUEST_ID.fullmatch(request_id):
        raise InvalidInput("request_id", "at most 128 characters of A-Z a-z 0-9 . _ : -")
    call.request_id = request_id
    trailers = ((REQUEST_ID_KEY, call.request_id),)
    front.set_trailers(trailers)
    return trailers
