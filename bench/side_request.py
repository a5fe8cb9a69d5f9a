"""A side request during a long generation: how long an agent's title call waits.

Serves the demo model (`python -m moefit.demo`) with --sessions 1, then 2, and in each starts a
long streamed completion, sends a short chat request a second later and times both. With one
session the side request waits for the long one to end; with two their steps are taken in turn
(serve/worker.py).

    python bench/side_request.py [--long 3000] [--side 8] [--port 8781]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import httpx

DEMO_FLAGS = ["--ctx", "8192", "--kv-dtype", "int8"]      # two sessions' state fits the demo's card


def serve(port: int, sessions: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moefit.demo", "--port", str(port), "--sessions", str(sessions),
                             *DEMO_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(proc.stderr.read())
        time.sleep(0.2)
    raise SystemExit("the demo server did not start")


def measure(port: int, sessions: int, long_tokens: int, side_tokens: int) -> tuple[float, float]:
    """(seconds of the side request, seconds of the long one)."""
    proc = serve(port, sessions)
    url, took = f"http://127.0.0.1:{port}", {}

    def long() -> None:
        t0 = time.perf_counter()
        body = {"prompt": "Once upon a time", "max_tokens": long_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for _ in r.iter_lines():
                pass
        took["long"] = time.perf_counter() - t0
    thread = threading.Thread(target=long)
    thread.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    side = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": "A title?"}], "max_tokens": side_tokens, "temperature": 0,
        "ignore_eos": True})
    took["side"] = time.perf_counter() - t0
    assert side.json()["usage"]["completion_tokens"] == side_tokens
    thread.join()
    proc.terminate()
    proc.wait()
    return took["side"], took["long"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=3000, help="tokens of the long generation")
    ap.add_argument("--side", type=int, default=8, help="tokens of the side request")
    ap.add_argument("--port", type=int, default=8781)
    args = ap.parse_args()
    print(f"demo model, {' '.join(DEMO_FLAGS)}; a {args.long}-token streamed completion, a {args.side}-token "
          "chat request 1 s into it")
    results = {n: measure(args.port, n, args.long, args.side) for n in (1, 2)}
    for n, (side, long) in results.items():
        print(f"--sessions {n}: side request {side:6.2f} s, long one {long:6.2f} s")
    print(f"side request {results[1][0] / results[2][0]:.0f}x sooner with two sessions; "
          f"the long one {results[2][1] / results[1][1]:.2f}x the time")


if __name__ == "__main__":
    main()
