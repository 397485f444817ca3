"""Load testing for the ScoreDocs service: synthetic request sets, an open/closed-loop gRPC driver, reports.

``python -m loadtest.gen`` writes requests, ``python -m loadtest.run`` replays them against a target,
``python -m loadtest.report compare`` puts two reports side by side, ``python -m loadtest.stub`` is a
no-model server for measuring the generator itself (``python -m loadtest.capacity``).
"""

from scorer.schemes import SCHEMES  # torch-free

__all__ = ["SCHEMES"]
