"""``torch``, imported on its first use (``importlib.util.LazyLoader``), for the modules a
front-end process imports: their tensor code runs only in the engine process, and torch's import
took a front end's start from 0.8 s and 69 MB to 4.3 s and 252 MB on the 2-core VM (``python -m
bench.frontend_start``). Such a module imports ``from .lazy_torch import torch`` and reads no
torch attribute at import time (no ``@torch...`` decorator, no module-level tensor or dtype); the
first attribute read anywhere, or a plain ``import torch`` (which reads ``__spec__``), imports it
whole, after which it is torch's own module object. Python 3.11's LazyLoader takes no lock, so the
first read must not race another thread's: the modules that build an engine (``scorer.attention``,
``scorer.runtime``) import torch plainly, so it loads on the thread that builds the engine, before
any call reaches tensor code; under ``scorer serve`` that is the main thread, alone (traced)."""

from __future__ import annotations

import importlib.util
import sys
import types


def _lazy(name: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def loaded() -> bool:
    """Has torch been imported (not only named) in this process?"""
    return "torch._C" in sys.modules


torch = _lazy("torch")
