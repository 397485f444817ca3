"""The Scorer service over gRPC: each call handed to the call handler (as the request's bytes when
registered through ``app.scorer_handlers``)."""

from __future__ import annotations

import grpc

from ..v1 import scorer_pb2 as pb
from ..v1 import scorer_pb2_grpc as pb_grpc
from .handler import CallHandler, GrpcFront


class ScorerServicer(pb_grpc.ScorerServicer):
    def __init__(self, handler: CallHandler) -> None:
        self.handler = handler

    async def ScoreDocs(self, request: bytes | pb.ScoreDocsRequest, context: grpc.aio.ServicerContext):
        return await self.handler.score_docs(request, GrpcFront(context))
