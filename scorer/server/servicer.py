"""The Scorer service: protobuf in, scoring service, protobuf out."""

from __future__ import annotations

import time

import grpc

from ..v1 import scorer_pb2 as pb
from ..v1 import scorer_pb2_grpc as pb_grpc
from .calls import current_call
from .convert import request_from_proto, response_to_proto
from .interceptor import NotReady
from .scoring import ScoringService


class ScorerServicer(pb_grpc.ScorerServicer):
    def __init__(self) -> None:
        self.service: ScoringService | None = None

    async def ScoreDocs(self, request: pb.ScoreDocsRequest, context: grpc.aio.ServicerContext):
        call = current_call()
        service = self.service
        if service is None:
            raise NotReady("the model is loading")
        tokenized, tokenize_seconds = await service.tokenize(request_from_proto(request, call.request_id))
        call.scheme = service.scheme(tokenized)
        scored = await service.score(tokenized, deadline_of(context), call.request_id)
        return response_to_proto(
            request,
            call.request_id,
            service.engine.model_name,
            scored,
            tokenize_seconds,
            time.monotonic() - call.started,
        )


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on ``time.monotonic``'s clock, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
