"""The gRPC server (``scorer serve``): front end, call handler, batcher, lifecycle."""

from .app import run

__all__ = ["run"]
