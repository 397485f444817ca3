"""Ray Serve on this machine, in the foreground: a local Ray, Serve's gRPC proxy and HTTP proxy, and
the scorer application; Ctrl-C (or SIGTERM) shuts Serve and Ray down and exits 0.

    make deploy-local                       # CPU replicas, the embedded toy model
    python -m scorer.ray_local --num-gpus 1 model=/models/Qwen3-Reranker-0.6B max_wait_ms=1

Every port it opens is a flag; a port another process listens on (another Ray, another
HAProxy) stops it before Ray starts, with one line naming the flag. The proxies and the replicas'
metrics bind ``--host``; HAProxy's stats and metrics ports bind every interface (Ray's HAProxy
template). Once the replicas are up, one line says where everything listens: gRPC
(``scorer.v1.Scorer``, ``grpc.health.v1.Health``), HTTP (the rerank routes under ``/scorer``),
each replica's ``scorer_`` metrics and Ray's own metrics. ``key=value`` arguments are the
application's ``ScorerArgs`` (docs/ray.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

APP = "scorer"
LOCAL_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
"""Ray's switches for one machine: a replica stops 2 s after it is told to, not 30 (Ray's default
lets load balancers on other hosts learn first; this machine's HAProxy learns at once), so Ctrl-C
stops Serve in seconds."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scorer.ray_local", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address of the proxies and the metrics")
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=9464, help="the replicas' scorer_ metrics (first)")
    p.add_argument("--ray-metrics-port", type=int, default=9465, help="Ray's own metrics (ray_serve_...)")
    p.add_argument(
        "--haproxy-stats-port", type=int, default=8404, help="HAProxy's stats page (every interface)"
    )
    p.add_argument(
        "--haproxy-metrics-port",
        type=int,
        default=9101,
        help="HAProxy's Prometheus metrics (every interface)",
    )
    p.add_argument(
        "--replica-grpc-ports",
        type=port_range,
        default=(40000, 41000),
        metavar="LOW-HIGH",
        help="ports the replicas' own gRPC servers take, behind HAProxy (another Ray on this host: a"
        " range of its own)",
    )
    p.add_argument(
        "--replica-http-ports",
        type=port_range,
        default=(30000, 31000),
        metavar="LOW-HIGH",
        help="ports the replicas' own HTTP servers take, behind HAProxy",
    )
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--num-gpus",
        type=float,
        default=0,
        help="per replica, or per engine with engine_process=shared (0: on the CPU)",
    )
    p.add_argument("--engines", type=int, default=1, help="with engine_process=shared: Engine replicas")
    p.add_argument("--replica-cpus", type=float, default=1, help="CPUs Ray reserves per replica")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--quiet", action="store_true", help="the replicas' logs stay in Ray's log files")
    p.add_argument("args", nargs="*", metavar="KEY=VALUE", help="ScorerArgs of the application")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    p = build_parser()
    ns = p.parse_intermixed_args(argv)  # KEY=VALUE before or after the flags
    app_args = {}
    for item in ns.args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"{item!r} is not KEY=VALUE")
        app_args[key] = value
    return ns, app_args


def port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = -1
    if not sep or not 0 < lo < hi <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW-HIGH, two ports with LOW < HIGH")
    return lo, hi


def listened_ports(ns: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """(flag, what, port, address it binds) of every fixed port this deployment listens on."""
    every = "0.0.0.0"
    return [
        ("--grpc-port", "Serve's gRPC ingress", ns.grpc_port, ns.host),
        ("--http-port", "Serve's HTTP ingress", ns.http_port, ns.host),
        ("--ray-metrics-port", "Ray's metrics", ns.ray_metrics_port, every),
        ("--haproxy-stats-port", "HAProxy's stats", ns.haproxy_stats_port, every),
        ("--haproxy-metrics-port", "HAProxy's metrics", ns.haproxy_metrics_port, every),
    ]


def taken_port(ns: argparse.Namespace) -> str | None:
    """One line naming the first port another process listens on, or None."""
    for name, what, port, host in listened_ports(ns):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                s.bind((host, port))
            except OSError as e:
                return (
                    f"port {port} ({what}, {name}) on {host} is taken ({e.strerror}): another process"
                    f" listens there, perhaps another Ray; pick a free one with {name} PORT"
                )
    return None


def ray_env(ns: argparse.Namespace) -> dict[str, str]:
    """Ray's variables for the ports that only its environment sets."""
    return {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(ns.haproxy_stats_port),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(ns.haproxy_metrics_port),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(ns.replica_grpc_ports[0]),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(ns.replica_grpc_ports[1]),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ns.replica_http_ports[0]),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ns.replica_http_ports[1]),
    }


def main(argv: list[str] | None = None) -> int:
    ns, app_args = parse(argv)
    taken = taken_port(ns)
    if taken:
        print(taken, file=sys.stderr)
        return 2
    # imported here: --help and bad flags answer without Ray's import time
    import ray
    from pydantic import ValidationError
    from ray import serve

    from .ray_serve import RAY_ENV, EngineDeployment, ScorerArgs, deployment_for, grpc_options, stop_haproxy

    try:
        args = ScorerArgs.model_validate(
            {"metrics_host": ns.host, "metrics_port": ns.metrics_port, **app_args}
        )
    except ValidationError as e:
        print(f"bad application argument: {e}", file=sys.stderr)
        return 2
    shared = args.engine_process == "shared"  # the replicas are front ends of ns.engines engines
    cpus = ns.num_cpus if ns.num_cpus is not None else len(os.sched_getaffinity(0))
    wanted = ns.replica_cpus * (ns.replicas + (ns.engines if shared else 0))
    if wanted > cpus:  # Ray would wait for them for ever, saying so only in its controller's log
        print(
            f"the replicas ask for {wanted:g} CPUs and this Ray has {cpus}: lower --replica-cpus"
            f" (0 runs them unreserved) or --replicas",
            file=sys.stderr,
        )
        return 2
    for key, value in {**RAY_ENV, **LOCAL_ENV}.items():  # before Ray starts: its processes inherit them
        os.environ.setdefault(key, value)
    os.environ.update(ray_env(ns))  # the flags'
    stop = threading.Event()
    context = ray.init(
        address="local",
        num_cpus=ns.num_cpus,
        num_gpus=ns.num_gpus * (ns.engines if shared else ns.replicas),
        include_dashboard=False,
        log_to_driver=not ns.quiet,
        _metrics_export_port=ns.ray_metrics_port,
    )
    # after ray.init, which installs its own SIGTERM handler (log and die: Serve, its HAProxy and
    # Ray's processes left running)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(
            http_options={"host": ns.host, "port": ns.http_port}, grpc_options=grpc_options(ns.grpc_port)
        )
        deployment = deployment_for(args).options(
            num_replicas=ns.replicas,
            ray_actor_options={"num_cpus": ns.replica_cpus, "num_gpus": 0 if shared else ns.num_gpus},
        )
        bound = [args.model_dump()]
        if shared:  # the Engine deployment the front ends join, with the GPUs
            gpu = {"num_cpus": ns.replica_cpus, "num_gpus": ns.num_gpus}
            engine = EngineDeployment.options(num_replicas=ns.engines, ray_actor_options=gpu)
            bound.append(engine.bind(args.model_dump()))
        handle = serve.run(deployment.bind(*bound), name=APP, route_prefix=f"/{APP}")
        # a handle called outside an event loop: RAY_ENV keeps Ray's router in a loop of its own
        ports = sorted({handle.metrics_port.remote().result() for _ in range(4 * ns.replicas)})
        if shared:
            engines = serve.get_deployment_handle("Engine", APP)
            ports += sorted({engines.metrics_port.remote().result() for _ in range(4 * ns.engines)})
        metrics = ", ".join(f"http://{ns.host}:{p}/metrics" for p in ports if p) or "off"
        switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RAY_SERVE_"))
        print(
            f"READY gRPC {ns.host}:{ns.grpc_port} (scorer.v1.Scorer), HTTP http://{ns.host}:{ns.http_port}"
            f"/{APP}, replica metrics {metrics}, Ray's metrics http://{ns.host}:{ns.ray_metrics_port}"
            f"/metrics, Ray session {context.address_info['session_dir']}, {switches}; Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("stopping: Serve, then Ray", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        node = ray.get_runtime_context().get_node_id()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            stop_haproxy(node)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")  # a busy small machine
    sys.exit(main())
