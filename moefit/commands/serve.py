"""moefit serve PACK [--host 127.0.0.1] [--port 8080] [--api-key KEY] [serve flags]"""

from __future__ import annotations

import os
from pathlib import Path

from moefit.cli import add_serve_flags, add_state_flags, serve_config, start_options


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the pack over an OpenAI-compatible HTTP API")
    p.add_argument("pack", help="the pack directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or set MOEFIT_API_KEY)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback address without an API key")
    p.add_argument("--served-model-name", help="the model id clients use (default: the pack's directory name)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting before 429 (default: 16)")
    p.add_argument("--max-body-mib", type=float, default=4.0, help="largest request body (default: 4 MiB)")
    p.add_argument("--keepalive-s", type=float, default=5.0, help="SSE keep-alive comment interval")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="web origins (https://app.example) allowed to call the API from a browser, besides "
                   "the server's own page; '*' allows any")
    p.add_argument("--stall-s", type=float, default=300.0,
                   help="a request whose forward makes no progress this long means a wedged engine: /health "
                   "turns 503 and the server exits 1 to be restarted (default: 300)")
    p.add_argument("--keep-sessions", action="store_true",
                   help="when the server stops, write the sessions' tokens and state under --state-dir, and take "
                   "them back at the next start of this pack with the same flags: a long prompt's next turn is "
                   "not prefilled again (runtime/kept.py)")
    add_serve_flags(p)
    add_state_flags(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.serve.server import Server, check_bind, setup_logging
    api_key = args.api_key or os.environ.get("MOEFIT_API_KEY") or None
    check_bind(args.host, api_key, args.insecure)
    setup_logging()
    http = {"host": args.host, "port": args.port, "api_key": api_key, "max_queue": args.max_queue,
            "model_name": args.served_model_name or Path(args.pack).resolve().name,
            "max_body_bytes": int(args.max_body_mib * (1 << 20)), "keepalive_s": args.keepalive_s,
            "allowed_origins": args.allowed_origins, "stall_s": args.stall_s, "keep_sessions": args.keep_sessions}
    return Server(args.pack, serve_config(args), start_options(args), http).run()
