"""The one place where exceptions become gRPC status codes, and where every call is counted.

Each unary call of the scorer's services runs inside a ``Call`` (request id for the logs, scheme
for the metrics); whatever it raises is answered with one status: INVALID_ARGUMENT naming the
field, RESOURCE_EXHAUSTED for over-capacity, INTERNAL only for real faults (logged with the
traceback), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .. import metrics
from ..request import InvalidInput
from .batcher import Closed, Dropped, OutOfMemory, QueueFull
from .calls import Inflight, close_call, open_call

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
INVALID_FIELD_KEY = "x-invalid-field"


class NotReady(Exception):
    """The model is still loading or warming up."""


Metadata = tuple[tuple[str, str], ...]


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


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the unary methods of services under ``package`` (e.g. "scorer.v1")."""

    def __init__(self, package: str, inflight: Inflight) -> None:
        self._prefix = f"/{package}."
        self._inflight = inflight

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not details.method.startswith(self._prefix):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            _guarded(details.method, handler.unary_unary, self._inflight),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _guarded(
    method: str, behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], inflight: Inflight
):
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call, token = open_call(method, getattr(request, "request_id", ""))
        request_id_md = ((REQUEST_ID_KEY, call.request_id),)
        code, message = grpc.StatusCode.OK, ""
        inflight.enter()
        try:
            context.set_trailing_metadata(request_id_md)
            return await behavior(request, context)
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            aborted_with = context.code()
            code = aborted_with if isinstance(aborted_with, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
            raise
        except Exception as exc:
            code, message, extra_md = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            await context.abort(code, message, trailing_metadata=request_id_md + extra_md)
        finally:
            seconds = time.monotonic() - call.started
            inflight.leave()
            metrics.observe_request(call.scheme, code.name, seconds)
            log.info(
                "%s %s scheme=%s %.1f ms%s",
                method,
                code.name,
                call.scheme,
                seconds * 1e3,
                f": {message}" if message else "",
            )
            close_call(token)

    return guarded
