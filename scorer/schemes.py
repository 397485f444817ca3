"""Scheme names, importable without torch (the load-test tool uses them too)."""

CONCRETE: tuple[str, ...] = (
    "naive",
    "split_cache",
    "ragged",
    "cascade",
    "multi_item",
    "custom_mask",
    "grouped",
)
SCHEMES: tuple[str, ...] = ("auto", *CONCRETE)
UNGROUPED: tuple[str, ...] = tuple(s for s in CONCRETE if s != "grouped")  # grouped takes a size
