#!/bin/bash
# NAME: deploy-local, load at concurrency 16 for 20 s, py-spy 10 s of the replica
cd /work/main
(.venv/bin/python -m scorer.ray_local --quiet max_wait_ms=1 > /tmp/rl-$1.log 2>&1 &)
for i in $(seq 120); do grep -q "^READY" /tmp/rl-$1.log && break; sleep 1; done
R=$(pgrep -f '^ray::ServeReplica:scorer:Scorer' | head -1)
(.venv/bin/python -m loadtest.run --target 127.0.0.1:9000 --requests /tmp/ri/ray_ingress/requests.jsonl --concurrency 16 --duration 20 --warmup 2 --schemes auto --quiet --no-samples --out /tmp/load-$1 > /tmp/load-$1.log 2>&1 &)
sleep 6
.venv/bin/py-spy record --pid $R --duration 10 --rate 200 --format raw --output /tmp/spy-$1.txt --nonblocking >/dev/null 2>&1
sleep 9
grep "concurrent" /tmp/load-$1.log
P=$(pgrep -f "python -m scorer.ray_local" | head -1); kill -INT $P; while kill -0 $P 2>/dev/null; do sleep 1; done; sleep 2
python3 - /tmp/spy-$1.txt <<'PY'
import sys
tot=handler=log=0
for line in open(sys.argv[1]):
    stack,_,n=line.rstrip().rpartition(' '); n=int(n)
    if '_direct_ingress' not in stack: continue
    tot+=n
    if 'CallHandler.score_docs' in stack:
        handler+=n
        if 'Logger.info' in stack: log+=n
print(sys.argv[1], "request path samples", tot, "handler", handler, "log line", log)
PY
