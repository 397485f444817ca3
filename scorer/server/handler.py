"""One ScoreDocs call from any front end: the only place where a call is opened, answered,
counted and logged, and where exceptions become status codes.

A front end (the gRPC servicer, the Ray deployment) wraps its transport in a ``Front`` (deadline,
trailers, how a failure is answered) and hands each call to ``CallHandler.score_docs``: it opens a
``Call`` (request id for the logs, in-flight count), converts the proto, tokenizes, scores through
the batcher and converts back; whatever is raised is answered with one status (INVALID_ARGUMENT
naming the field, RESOURCE_EXHAUSTED for over-capacity, UNAVAILABLE while loading or draining,
INTERNAL only for real faults, logged with the traceback), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import grpc

from .. import metrics
from ..request import InvalidInput
from ..v1 import scorer_pb2 as pb
from .batcher import Closed, Dropped, OutOfMemory, QueueFull
from .calls import Inflight, close_call, open_call
from .convert import request_from_proto, response_to_proto
from .scoring import ScoringService

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
INVALID_FIELD_KEY = "x-invalid-field"
SCORE_METHOD = "/scorer.v1.Scorer/ScoreDocs"
Metadata = tuple[tuple[str, str], ...]


class NotReady(Exception):
    """The model is still loading or warming up."""


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str, Metadata]:
    """The status code, details and extra trailing metadata that answer ``exc``."""
    if isinstance(exc, InvalidInput):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ((INVALID_FIELD_KEY, exc.field),)
    if isinstance(exc, QueueFull | OutOfMemory):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or type(exc).__name__, ()
    if isinstance(exc, Dropped):
        code = grpc.StatusCode.CANCELLED if exc.reason == "cancelled" else grpc.StatusCode.DEADLINE_EXCEEDED
        return code, str(exc), ()
    if isinstance(exc, NotReady | Closed):
        return grpc.StatusCode.UNAVAILABLE, str(exc), ()
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log", ()


class Front(Protocol):
    """What the handler needs of a transport."""

    def deadline(self, started: float) -> float | None:
        """The call's deadline on ``time.monotonic``'s clock, or None."""

    def set_trailers(self, trailers: Metadata) -> None: ...

    def cancelled_code(self) -> grpc.StatusCode:
        """The code of a call cancelled under the handler: its deadline passed, or the client left."""

    async def fail(
        self, code: grpc.StatusCode, message: str, trailers: Metadata, exc: Exception
    ) -> pb.ScoreDocsResponse:
        """Answer the call with ``code``; may raise (gRPC's abort does)."""


class GrpcFront:
    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    def deadline(self, started: float) -> float | None:
        remaining = self.context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    def set_trailers(self, trailers: Metadata) -> None:
        self.context.set_trailing_metadata(trailers)

    def cancelled_code(self) -> grpc.StatusCode:
        remaining = self.context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED

    async def fail(self, code, message, trailers, exc) -> pb.ScoreDocsResponse:
        await self.context.abort(code, message, trailing_metadata=trailers)
        raise AssertionError("abort returned")  # pragma: no cover


class CallHandler:
    """``service`` is None until the model is loaded (calls get UNAVAILABLE)."""

    def __init__(self, inflight: Inflight | None = None) -> None:
        self.inflight = inflight or Inflight()
        self.service: ScoringService | None = None

    async def score_docs(self, request: pb.ScoreDocsRequest, front: Front) -> pb.ScoreDocsResponse:
        call, token = open_call(SCORE_METHOD, request.request_id)
        trailers = ((REQUEST_ID_KEY, call.request_id),)
        code, message = grpc.StatusCode.OK, ""
        self.inflight.enter()
        try:
            front.set_trailers(trailers)
            return await self._score(request, call, front)
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
            metrics.observe_request(call.scheme, code.name, seconds)
            log.info(
                "%s %s scheme=%s %.1f ms%s",
                SCORE_METHOD,
                code.name,
                call.scheme,
                seconds * 1e3,
                f": {message}" if message else "",
            )
            close_call(token)

    async def _score(self, request: pb.ScoreDocsRequest, call, front: Front) -> pb.ScoreDocsResponse:
        service = self.service
        if service is None:
            raise NotReady("the model is loading")
        job, tokenize_seconds = await service.tokenize(request_from_proto(request, call.request_id))
        call.scheme = job.scheme.name
        scored = await service.score(job, front.deadline(call.started), call.request_id)
        return response_to_proto(
            job,
            call.request_id,
            service.engine.model_name,
            scored,
            tokenize_seconds,
            time.monotonic() - call.started,
        )
