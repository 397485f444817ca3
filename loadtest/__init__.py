"""Load testing for the ScoreDocs service: synthetic request sets, an open/closed-loop gRPC driver, reports.

``python -m loadtest.gen`` writes requests, ``python -m loadtest.run`` replays them against a target,
``python -m loadtest.report compare`` puts two reports side by side, ``python -m loadtest.stub`` is a
no-model server for measuring the generator itself (``python -m loadtest.capacity``).
"""

SCHEMES: tuple[str, ...] = (
    "auto",
    "naive",
    "split_cache",
    "ragged",
    "cascade",
    "multi_item",
    "custom_mask",
    "grouped",
)
"""The scheme names ScoreOptions.scheme accepts (kept here so loadtest never imports torch)."""
