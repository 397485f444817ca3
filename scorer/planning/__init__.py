"""Planning: shapes in, checked FlashInfer metadata out. The scheme registry (``schemes``), the
batch planner (``batch``), ``auto``'s policies (``choose``) and the plan data (``base``)."""

from __future__ import annotations

from .base import ItemLoc, Pass, Plan, PlanError, Shape, check_plan
from .batch import combine, plan_batch
from .choose import article_choice
from .schemes import AUTO, REGISTRY, Scheme, get, names, scheme

__all__ = [
    "AUTO",
    "REGISTRY",
    "ItemLoc",
    "Pass",
    "Plan",
    "PlanError",
    "Scheme",
    "Shape",
    "article_choice",
    "check_plan",
    "combine",
    "get",
    "names",
    "plan_batch",
    "scheme",
]
