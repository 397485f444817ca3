"""Wait until a scorer reports SERVING (gRPC health; with --http, its HTTP /health too):
python3 scripts/gpu/wait_serving.py PID [--target HOST:PORT] [--service NAME] [--http URL]
[--seconds N].
Exits 1 when the process PID dies first or the time runs out."""

import argparse
import os
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ap = argparse.ArgumentParser()
ap.add_argument("pid", type=int)
ap.add_argument("--target", default="127.0.0.1:50051")
ap.add_argument("--service", default="", help="the health service asked for (default: the server's)")
ap.add_argument("--http", help="an HTTP /health URL that must answer 200 as well")
ap.add_argument("--seconds", type=float, default=240.0)
a = ap.parse_args()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(a.target))
t0 = time.time()
while time.time() - t0 < a.seconds:
    try:
        os.kill(a.pid, 0)
    except OSError:
        sys.exit("the server died before serving")
    try:
        if (
            stub.Check(health_pb2.HealthCheckRequest(service=a.service), timeout=2).status
            == health_pb2.HealthCheckResponse.SERVING
        ):
            if a.http:
                with urllib.request.urlopen(a.http, timeout=2) as r:
                    assert r.status == 200, r.status
            print(
                f"{a.target} serving{' (and HTTP)' if a.http else ''} after {time.time() - t0:.0f} s",
                flush=True,
            )
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(1)
sys.exit(f"server not ready after {a.seconds:.0f} s")
