"""Load tests for the scorer's gRPC ScoreDocs service: request generation (``gen``), an open-loop
driver with a report (``run``, ``report``), a stub server for testing the tool itself (``stub``).
See docs/loadtest.md."""


def schemes() -> tuple[str, ...]:
    """The scheme names a call may ask for (the scorer's registry; imported on first use)."""
    from scorer.planning import names

    return names()


__all__ = ["schemes"]
