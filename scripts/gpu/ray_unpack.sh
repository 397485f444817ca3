#!/usr/bin/env bash
# On a GPU machine without network (.ray-bundle/ copied there, built by ray_bundle.sh): unpacks the Ray Serve
# archive with Python's tarfile into /tmp/ray-site, each distribution the image lacks (the image's
# own copy is kept where it has one at the same version or newer), and checks that Ray and Serve
# import from there. /tmp outlives the run while the machine stays warm: start run 2
# (ray_bench.sh, with the FlashInfer kit) within 30 s.
#   bash scripts/gpu/ray_unpack.sh
set -euo pipefail
ARCHIVE=.ray-bundle/ray-serve-2.60.0-cp312.tar.xz
SITE=/tmp/ray-site
[ -f "$ARCHIVE" ] || { echo "no $ARCHIVE: run scripts/gpu/ray_bundle.sh and copy .ray-bundle/ here" >&2; exit 1; }
rm -rf "$SITE"
python3 - "$ARCHIVE" "$SITE" <<'PY'
import importlib.metadata as md
import shutil
import sys
import tarfile
import tempfile
from email.parser import Parser
from pathlib import Path

from packaging.version import Version

archive, site = Path(sys.argv[1]), Path(sys.argv[2])
with tempfile.TemporaryDirectory(dir="/tmp") as stage:
    with tarfile.open(archive) as tar:
        tar.extractall(stage, filter="data")
    for dist in sorted((Path(stage) / "dists").iterdir()):
        (info,) = dist.glob("*.dist-info")
        meta = Parser().parsestr((info / "METADATA").read_text(), headersonly=True)
        name, version = meta["Name"], meta["Version"]
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is not None and Version(have) >= Version(version):
            print(f"image's {name} {have} kept (bundle: {version})")
            continue
        shutil.copytree(dist, site, dirs_exist_ok=True)
        print(f"{name} {version}" + (f" over the image's {have}" if have else ""))
# wheels are zip files, which keep no permissions: Ray's own binaries (gcs_server, raylet) and
# every other ELF file must be executable again
n = 0
for f in site.rglob("*"):
    if f.is_file() and not f.is_symlink():
        with f.open("rb") as fh:
            if fh.read(4) == b"\x7fELF":
                f.chmod(f.stat().st_mode | 0o111)
                n += 1
print(f"{n} ELF files made executable")
PY
PYTHONPATH="$SITE" python3 -c "
import ray, ray.serve, fastapi, uvicorn, grpc_reflection
print('ray', ray.__version__, 'from', ray.__file__)"
du -sm "$SITE"
