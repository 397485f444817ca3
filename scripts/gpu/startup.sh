#!/usr/bin/env bash
# Where a server's start goes before it listens (scorer serve reported SERVING 32-44 s after its
# start on the H200 in session 8; a Ray replica's model loaded 30 s after its process started):
# the imports of the server and of a Ray replica, twice each (cold, then with the page cache and
# the bytecode caches warm), their 15 costliest modules by cumulative time (python -X importtime).
#   bash scripts/gpu/startup.sh     device: carry [".gpu"] (Ray too: RAY_SITE=/tmp/ray-site after ray_unpack.sh)
#   -> $OUT/startup.md
source scripts/gpu/env.sh
set -euo pipefail
[ -d "${RAY_SITE:-/tmp/ray-site}/ray" ] && export PYTHONPATH="$PYTHONPATH:${RAY_SITE:-/tmp/ray-site}"
{
  for mod in scorer.server.app scorer.ray_serve; do
    for run in cold warm; do
      start=$(date +%s.%N)
      python3 -X importtime -c "import $mod, torch; torch.cuda.init()" 2>/tmp/imports.txt || { echo "$mod: failed"; continue; }
      echo "## import $mod + CUDA init ($run): $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s wall"
      echo
      echo '| cumulative ms | module |'
      echo '|---:|---|'
      python3 - <<'PY'
rows = []
for line in open("/tmp/imports.txt"):
    if not line.startswith("import time:") or "cumulative" in line:
        continue
    _, cum_us, name = line.split("|")
    rows.append((int(cum_us), name.strip()))
for cum, name in sorted(rows, reverse=True)[:15]:
    print(f"| {cum / 1e3:,.0f} | `{name}` |")
PY
      echo
    done
  done
} | tee "$OUT/startup.md"
