"""A bounded loopback load test of `moefit serve` (not a test): N requests from C concurrent
clients, mixed prompt and answer lengths, some cancelled mid-stream. Prints requests/s,
p50/p99 time to first token, errors by status, and the server's RSS before and after.

    .venv/bin/python bench/load.py PACK [--requests 200] [--clients 8] [--device sim:CARD]

Only 127.0.0.1 is ever contacted; the server is started and stopped here.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import psutil

WORDS = "the lantern river king light night sea people morning evening word water fire".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moefit", "serve", args.pack, "--port", str(port), "--device", args.device,
           "--ctx", "2048", "--max-queue", str(args.clients * 2), "--settle-s", "0", *args.extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def one_request(url: str, rng: random.Random, results: list, lock: threading.Lock) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
    body = {"prompt": prompt, "max_tokens": rng.choice([8, 32, 64]), "stream": True}
    cancel_after = rng.randint(1, 4) if rng.random() < 0.15 else None
    t0, ttft, status = time.perf_counter(), None, 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            status = r.status_code
            for i, line in enumerate(r.iter_lines()):
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - t0
                if cancel_after is not None and i >= cancel_after:
                    status = "cancelled"
                    break
    except httpx.TransportError as e:
        status = type(e).__name__
    with lock:
        results.append((status, ttft, time.perf_counter() - t0))


def client(url: str, seed: int, count: int, results: list, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        one_request(url, rng, results, lock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("extra", nargs="*", help="more `moefit serve` flags (after --)")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        rss_before = psutil.Process(proc.pid).memory_info().rss
        results, lock = [], threading.Lock()
        per = args.requests // args.clients
        threads = [threading.Thread(target=client, args=(url, i, per, results, lock)) for i in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        rss_after = psutil.Process(proc.pid).memory_info().rss
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report(results, wall, rss_before, rss_after, args)


def report(results, wall, rss_before, rss_after, args) -> None:
    ttfts = sorted(t for s, t, _ in results if t is not None and s == 200)
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")  # noqa: E731
    print(f"{len(results)} requests from {args.clients} clients in {wall:.1f} s: {len(results) / wall:.2f} requests/s")
    print(f"time to first token: p50 {pct(0.5):.3f} s, p99 {pct(0.99):.3f} s "
          f"(mean {statistics.mean(ttfts) if ttfts else float('nan'):.3f} s)")
    print("outcomes:", dict(Counter(str(s) for s, _, _ in results)))
    print(f"server RSS: {rss_before / 2**20:.0f} MiB before, {rss_after / 2**20:.0f} MiB after")


if __name__ == "__main__":
    main()
