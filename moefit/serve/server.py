"""Run the server: listen at once (/health says 503 while loading), start the engine
through the start-up discipline in the background, record the run in the history.

Stopping (SIGTERM, Ctrl-C): stop taking requests, end the running stream with a final
chunk (finish_reason "abort") and [DONE], join the engine thread, write the history row,
exit 0. An engine that cannot go on makes the process exit 1, so a service manager
restarts it rather than leaving it "healthy" and hung.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import threading

import uvicorn

from moefit.errors import MoefitError, UsageError
from moefit.serve.app import ServerState, create_app, sample_cache
from moefit.serve.crosssite import CrossSite, is_loopback
from moefit.serve.worker import Worker

HISTORY_EVERY_S = 30.0
SAMPLE_EVERY_S = 2.0               # a point of the page's hit-rate chart
PROFILE_EVERY_S = 300.0
JOIN_S = 30.0                      # how long stopping waits for the engine thread's last step


def check_port(host: str, port: int) -> None:
    """MoefitError (exit 1) naming who holds the port, before anything is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise MoefitError(f"cannot listen on {host}:{port} ({e.strerror})") from None
            raise MoefitError(f"port {port} is in use{port_holder(port)}; stop it or pick another --port") from None


def port_holder(port: int) -> str:
    """' (pid 123, python3)' when the holder can be seen, else ''."""
    import psutil
    try:
        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" (pid {c.pid}, {psutil.Process(c.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling us first when a signal asks it to stop."""

    def __init__(self, config, on_stop):
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig, frame) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)


def check_bind(host: str, api_key: str | None, insecure: bool) -> None:
    if not is_loopback(host) and not api_key and not insecure:
        raise UsageError(f"refusing to listen on {host} without an API key: give --api-key (or MOEFIT_API_KEY), "
                         "or --insecure if this network is yours alone")


class Server:
    """Usage: Server(pack, cfg, opts, http).run() -> exit code"""

    def __init__(self, pack, cfg, start_opts, http: dict):
        self.pack, self.cfg, self.start_opts, self.http = pack, cfg, start_opts, http
        self.state = ServerState(http["model_name"], http["api_key"], http["max_body_bytes"], http["keepalive_s"],
                                 cross_site=CrossSite(is_loopback(http["host"]), tuple(http["allowed_origins"])))
        self.exit_code = 0
        self._stop = threading.Event()
        config = uvicorn.Config(create_app(self.state), host=http["host"], port=http["port"], log_level="warning",
                                timeout_graceful_shutdown=5)
        self.uvicorn = _Uvicorn(config, self._draining)
        self.loader = threading.Thread(target=self._load, name="moefit-load", daemon=True)

    def run(self) -> int:
        check_port(self.http["host"], self.http["port"])
        self.loader.start()
        # uvicorn shuts down on SIGTERM, then raises it again: end through our finally, not abruptly
        signal.signal(signal.SIGTERM, _exit_on_term)
        try:
            self.uvicorn.run()
        finally:
            self._shutdown()
        return self.exit_code

    def _draining(self) -> None:
        if self.state.worker is not None:
            self.state.worker.drain()

    def _fatal(self, reason: str) -> None:
        print(f"moefit: the engine cannot go on ({reason}); exiting so that it can be restarted",
              file=sys.stderr, flush=True)
        self.exit_code = 1
        self.uvicorn.should_exit = True

    def _load(self) -> None:
        from moefit.ops.startup import start_engine
        from moefit.runtime.guard import Guard
        try:
            engine, start = start_engine(self.pack, self.cfg, self.start_opts, command="serve")
        except MoefitError as e:
            self.state.load_error = str(e).splitlines()[0]
            print(f"moefit: {e}", file=sys.stderr, flush=True)
            self.exit_code = e.exit_code
            self.uvicorn.should_exit = True
            return
        if self.http.get("keep_sessions"):
            self._kept("restore", engine)
        guard = Guard(engine, self.cfg.min_free_vram_mib << 20, self.cfg.grow_margin_mib << 20)
        self.state.guard, self.state.start = guard, start
        self.state.worker = Worker(engine, guard, self.state.metrics, self.http["max_queue"],
                                   stall_s=self.http["stall_s"], on_fatal=self._fatal)
        self.state.engine = engine
        print(banner(self.http, self.state.model_name), file=sys.stderr, flush=True)
        threading.Thread(target=self._record_loop, name="moefit-history", daemon=True).start()

    def _record(self, final: bool = False) -> None:
        engine, start, guard = self.state.engine, self.state.start, self.state.guard
        if engine is not None and start is not None:
            start.finish(engine, final, guard_warnings=guard.warnings, cache_resizes=guard.resizes)

    def _record_loop(self) -> None:
        """Every 2 s a chart sample; every 30 s the history row; every 5 min the profile."""
        waited = 0.0
        while not self._stop.wait(SAMPLE_EVERY_S):
            sample_cache(self.state)
            waited += SAMPLE_EVERY_S
            if waited % HISTORY_EVERY_S < SAMPLE_EVERY_S:
                self._record()
            if waited % PROFILE_EVERY_S < SAMPLE_EVERY_S:
                self.state.engine.save_profile()

    def _shutdown(self) -> None:
        self._stop.set()
        self.loader.join(JOIN_S)                     # never exit under a thread that is still in torch
        worker = self.state.worker
        if worker is not None:
            worker.drain()
            if not worker.join(JOIN_S) and not worker.fatal:
                print("moefit: warning: the engine thread did not stop in time", file=sys.stderr, flush=True)
        if self.state.engine is not None and (worker is None or not worker.thread.is_alive()):
            if self.http.get("keep_sessions") and not (worker is not None and worker.fatal):
                self._kept("save", self.state.engine)
            self._record(final=True)
            try:
                self.state.engine.save_profile()
            except OSError as e:
                print(f"moefit: warning: could not save the learned profile ({e})", file=sys.stderr)
        print("moefit: stopped", file=sys.stderr, flush=True)

    def _kept(self, way: str, engine) -> None:
        """--keep-sessions: take the kept sessions back (at start) or keep them (at the stop)."""
        from moefit.runtime import kept
        where = kept.folder(self.start_opts.state_dir, engine)
        try:
            lines = getattr(kept, way)(engine, where)
        except (OSError, RuntimeError) as e:
            lines = [f"not kept ({e})"]
        for line in lines:
            print(f"moefit: {line}", file=sys.stderr, flush=True)


def _exit_on_term(signum, frame) -> None:
    raise SystemExit(0)


def banner(http: dict, model: str) -> str:
    url = f"http://{http['host']}:{http['port']}"
    auth = f" -H 'Authorization: Bearer {'$MOEFIT_API_KEY'}'" if http["api_key"] else ""
    key = "os.environ['MOEFIT_API_KEY']" if http["api_key"] else "'none'"
    return f"""
moefit is serving {model} at {url}  (page: {url}/, status: {url}/v1/status, metrics: {url}/metrics)

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Define: lantern"}}], "max_tokens": 40}}'

  {sys.executable} -c "from openai import OpenAI; import os; c = OpenAI(base_url='{url}/v1', api_key={key}); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Define: lantern'}}], \\
max_tokens=40).choices[0].message.content)"

Ctrl-C stops it.
"""


def setup_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="moefit: %(message)s")
