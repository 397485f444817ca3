"""The gRPC server (``scorer serve``): front end, call handler, batcher, lifecycle.

``run`` checks the settings before transformers, gRPC and the engine are imported (``app``): a flag
that cannot work is refused in 2.3 s on a 2-core CI machine (most of it torch's import, which some
checks need), where after the server's imports it took about 6.5 s."""

from __future__ import annotations

import argparse
import logging


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code (2: a setting that cannot work)."""
    from ..settings import SERVE, from_args
    from .calls import configure_logging

    configure_logging("INFO")
    log = logging.getLogger("scorer.server")
    try:
        settings = from_args(args, SERVE)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        from . import app
    except ImportError as e:  # gRPC's generated stubs refuse an older grpcio or protobuf runtime
        log.error("the server cannot start: %s", e)
        return 2
    return app.run(settings)


__all__ = ["run"]
