"""The package's metadata: compatible ranges that admit the GPU image's versions (so installing
there keeps its CUDA torch), the exact versions CI runs on in constraints.txt, and make using them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The GPU machine's image and the kit's wheels, which the code must run on as they are.
GPU_IMAGE = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "grpcio": "1.84.0",
    "grpcio-health-checking": "1.84.0",
    "grpcio-reflection": "1.84.0",
    "protobuf": "7.36.2",
    "flashinfer-python": "0.6.15.post1",
}


def requirements(*extras: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return {r.name.lower(): r for r in reqs if r.name != "scorer"}


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = Version(version)
    return pins


@pytest.mark.parametrize(("name", "version"), GPU_IMAGE.items())
def test_the_ranges_admit_the_gpu_images_versions(name, version):
    req = requirements("gpu")[name]
    assert req.specifier.contains(version, prereleases=True), f"{req} refuses the GPU image's {version}"


def test_no_runtime_dependency_is_pinned_to_one_version():
    for req in requirements("http", "gpu", "ray").values():
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req} is an exact pin"
        assert req.specifier, f"{req} has no range"


def test_constraints_pin_every_dependency_within_its_range():
    pins = constraints()
    for name, req in requirements("http", "ray", "dev").items():
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt's {pins[name]} ∉ {req}"
    assert pins["torch"] == Version("2.13.0")  # the CPU build on local disk: never a CUDA download


def test_make_installs_only_through_the_constraints():
    installs = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs


def test_serving_needs_neither_ray_nor_the_test_tools():
    serve = requirements("http")
    assert not {"ray", "pytest", "cohere", "ruff", "matplotlib"} & set(serve)
    assert {"fastapi", "uvicorn"} <= set(serve)
