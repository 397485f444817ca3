#!/usr/bin/env bash
# Run here (not on the GPU machine): downloads into .wheels/ (git-ignored) the wheels of the HTTP
# stack that the GPU image lacks, at this venv's exact versions, for its Python 3.12 on x86_64:
# the server's FastAPI on uvicorn (with httptools, uvicorn's fast parser) and the load tool's
# aiohttp client (--api cohere|jina|tei), py-spy (profiles), with every dependency of theirs: the image has torch,
# grpcio, protobuf, prometheus-client, transformers and numpy, and may have typing-extensions,
# anyio, h11, idna, click or attrs (through torch, transformers' huggingface-hub, hypothesis) but at
# versions unknown here (pydantic and anyio want typing-extensions >= 4.16), so ours travel too and
# go first on the path. scripts/gpu/env.sh's use_wheels installs them where .wheels/ is present on the GPU machine.
#   bash scripts/gpu/wheels.sh [python of the venv, default .venv/bin/python]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-.venv/bin/python}"
PACKAGES="fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc
  typing-extensions opentelemetry-api anyio idna uvicorn h11 click httptools
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl py-spy"
# every requirement of theirs (for Python 3.12 on Linux, no extras) must be in the list
mapfile -t PINS < <("$PY" - $PACKAGES <<'PY'
import sys
from importlib.metadata import distribution
from packaging.markers import default_environment
from packaging.requirements import Requirement

listed = {n.lower() for n in sys.argv[1:]}
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
for name in sorted(listed):
    dist = distribution(name)
    for r in map(Requirement, dist.requires or []):
        dep = r.name.lower().replace("_", "-")
        if (not r.marker or r.marker.evaluate(env)) and dep not in listed:
            sys.exit(f"{name} needs {dep}, which is not listed")
    print(f"{name}=={dist.version}")
PY
)
rm -rf .wheels && mkdir -p .wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .wheels "${PINS[@]}"
n=$(ls .wheels/*.whl | wc -l)
[ "$n" -eq "${#PINS[@]}" ] || { echo "expected ${#PINS[@]} wheels, got $n" >&2; exit 1; }
echo "$n wheels, $(du -sh .wheels | cut -f1) in .wheels/"
