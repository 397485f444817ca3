"""Wait until the scorer at 127.0.0.1:50051 reports SERVING: python3 wait_serving.py PID [seconds].
Exits 1 when the server process PID dies first or the time runs out."""

import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

pid, limit = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 240.0
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel("127.0.0.1:50051"))
t0 = time.time()
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server died before serving")
    try:
        if (
            stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            == health_pb2.HealthCheckResponse.SERVING
        ):
            print(f"serving after {time.time() - t0:.0f} s", flush=True)
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(1)
sys.exit(f"server not ready after {limit:.0f} s")
