"""The one place that sets environment variables for the embedded Ray, before it starts: what Ray and Serve read at
start-up, and so cannot take from AppConfig. Each one's effect is in docs/configuration.md. No torch.
"""

from __future__ import annotations

import os

from service.haproxy_nosplice import BINARY_PATH_VAR
from service.http.limits import PROXY_LIMITS_ENV
from service.limits import MAX_HEADER_BYTES
from service.local.ports import is_loopback

# Ray's metrics agent would keep every series a replica ever reported until Ray restarts, so the export would grow
# with every replica restart. Set by the local launcher and on the cluster's pods (deploy/k8s/base/rayservice.yaml).
BOUNDED_METRICS_ENV = {
    # Ray's OpenCensus path: the agent drops all of a worker's series once it has not reported for
    # RAY_WORKER_TIMEOUT_S (120 s). The default OpenTelemetry path keeps dead workers' counters and histograms.
    "RAY_enable_open_telemetry": "0",
    # That path's default aggregation labels a name's series from every worker with one worker's label names:
    # Serve's proxy and replicas name serve_event_loop_* labels differently, and every scrape fails (HTTP 500).
    "RAY_metric_cardinality_level": "legacy",
    # Within one worker too: the router's own loop reports them without the replica's labels. On the replica's loop,
    # as the throughput-optimized mode runs it, there is none.
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Serve's controller outlives the replicas: without their ids on its metrics, a restart adds none of its series.
    "RAY_SERVE_CONTROLLER_METRICS_INCLUDE_HIGH_CARDINALITY_TAGS": "0",
}

# Serve's controller replaces a dead proxy (or HAProxy's manager) after 3 failed health checks in a row, one every
# this many seconds: the node refused connections for ~25 s with Ray's default 10 s, ~5 s with 1 s, whichever the
# way in (benchmarks/cluster_faults).
PROXY_HEALTH_ENV = {"RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "1"}
# Wherever Serve's controller runs: the local launcher, the tests' Serve, every pod.
SERVE_RAY_ENV = {**BOUNDED_METRICS_ENV, **PROXY_HEALTH_ENV}

# Serve's HAProxy ingress: HAProxy holds the node's HTTP and gRPC ports and forwards each request to an ingress
# replica's own server, where Serve's proxy is a Python process per node between them (6.1-6.8 x the requests over
# HTTP, docs/benchmarks.md). HAProxy refuses a head over its buffer with its own HTML 400: the buffer holds a head
# somewhat over max_header_bytes, so the replica answers that with the JSON 431.
HAPROXY_BUFSIZE = MAX_HEADER_BYTES + (16 << 10)
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(HAPROXY_BUFSIZE)}

# Serve's HAProxy runs without kernel splicing (service/haproxy_nosplice.py): the image links the program here and
# sets the variable to it, where Ray's nodes read it (tests/test_image.py checks).
HAPROXY_PROGRAM = "mha-serving-haproxy"
IMAGE_HAPROXY_ENV = {BINARY_PATH_VAR: f"/usr/local/bin/{HAPROXY_PROGRAM}"}

# Every pod of the RayService sets these (deploy/k8s/base/rayservice.yaml; tests/test_metrics_bounded.py checks).
CLUSTER_RAY_ENV = {**SERVE_RAY_ENV, **HAPROXY_ENV}

# Set with setdefault: the user's own values win.
LOCAL_RAY_ENV = {
    # Ray starts its workers at nice 15: any normal process on the machine (a load generator, a build) would starve
    # the replicas. A local server runs them at normal priority.
    "RAY_worker_niceness": "0",
    # User code on the replica's main event loop, gRPC between deployments, frozen GC: less CPU per request.
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Serve's controller reconciles every 0.1 s, asking the GCS for the cluster's state each time; on one machine
    # there is nothing to scale, and the slower pass only delays a failed replica's restart.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # The ingress serves the API on its own server (service/http/server.py): Serve's direct-ingress server in the
    # replica (on by default with the throughput-optimized mode) would be a second way in.
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    # No Ray started behind the launcher's back: a Serve long-poll client's late update during shutdown once called
    # ray.init() from Ray's callback thread, and shutdown waited on it until SIGKILL.
    "RAY_ENABLE_AUTO_CONNECT": "0",
    # With --proxy: Serve's proxy checks the default request limits before it reads a body, as on a cluster.
    **PROXY_LIMITS_ENV,
    **SERVE_RAY_ENV,
}
# With --access-log: Serve's logger writes each line to stderr too (which Ray forwards to the server's output) and at
# once (the throughput-optimized mode buffers the request path's lines 1,000 at a time).
ACCESS_LOG_ENV = {"RAY_SERVE_LOG_TO_STDERR": "1", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}
# Ray's single-machine mode: the node's address is 127.0.0.1, so Ray's metrics ports, agents and gRPC servers listen
# on loopback only. For another --host, Ray binds them on every interface (Ray offers loopback or all, not one).
RAY_ON_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# Serve's gRPC proxy takes messages up to 2 GiB unless told less; the replica's own gRPC server is held to the body
# limit by gRPC itself (service/rpc/server.py).
GRPC_PROXY_LIMIT_VAR = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def ray_env(host: str, access_log: bool = False, grpc_proxy_limit: int | None = None) -> dict[str, str]:
    """The environment for an embedded Ray serving the API on `host`; `grpc_proxy_limit`: the largest message
    Serve's gRPC proxy takes (bytes), where it serves gRPC."""
    loopback = RAY_ON_LOOPBACK if is_loopback(host) else {}
    grpc = {} if grpc_proxy_limit is None else {GRPC_PROXY_LIMIT_VAR: str(grpc_proxy_limit)}
    return {**LOCAL_RAY_ENV, **loopback, **(ACCESS_LOG_ENV if access_log else {}), **grpc}


def set_ray_env(host: str, access_log: bool = False, grpc_proxy_limit: int | None = None) -> None:
    """Set `ray_env(...)` in this process's environment (inherited by Ray's processes), the user's values kept."""
    for key, value in ray_env(host, access_log, grpc_proxy_limit).items():
        os.environ.setdefault(key, value)


# Ray's documented switch, read once as ray is imported: the process's Ray driver installs no C++ failure-signal
# handler. Ray's shutdown uninstalls that handler by resetting SIGTERM to its default, which would end a server that
# is still stopping (and ignores stop signals by then) at the next SIGTERM.
NO_FAILURE_SIGNAL_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def import_ray_for_the_server() -> None:
    """Import ray in the server process without the driver's failure-signal handler, unless the user set the switch
    themselves; Ray's own processes (started later, inheriting the environment) keep theirs. No effect where ray was
    imported before."""
    user_set = NO_FAILURE_SIGNAL_HANDLER in os.environ
    os.environ.setdefault(NO_FAILURE_SIGNAL_HANDLER, "1")
    try:
        import ray  # noqa: F401
    finally:
        if not user_set:
            del os.environ[NO_FAILURE_SIGNAL_HANDLER]
