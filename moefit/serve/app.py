"""The OpenAI-compatible HTTP API. Errors are mapped to OpenAI-style JSON in one place;
no response ever carries a traceback or a file path."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from moefit.errors import DeviceUnavailable
from moefit import __version__
from moefit.serve import anthropic, responses
from moefit.serve import protocol as P
from moefit.serve.completions import ChatRun, CompletionRun, answer_runs
from moefit.serve.crosssite import CrossSite
from moefit.serve.metrics import Metrics

log = logging.getLogger("moefit.serve")
access = logging.getLogger("moefit.access")
STATIC = Path(__file__).parent / "static"
OPEN_PATHS = {"/health", "/", "/favicon.ico"}
POLLED = {"/health", "/v1/status", "/v1/history", "/metrics", "/", "/favicon.ico"}   # logged at debug level


@dataclass
class ServerState:
    model_name: str
    api_key: str | None
    max_body_bytes: int = 4 << 20
    keepalive_s: float = 5.0
    engine: object = None
    worker: object = None
    guard: object = None
    start: object = None
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)
    load_error: str | None = None
    samples: deque = field(default_factory=lambda: deque(maxlen=400))   # the page's chart, kept by the server
    cross_site: CrossSite = field(default_factory=lambda: CrossSite(loopback_bind=True))

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def down(self) -> str | None:
        """Why this server cannot serve (a failed load, a dead engine), or None."""
        return self.load_error or (self.worker.health() if self.worker is not None else None)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moefit", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.moefit = state

    @app.middleware("http")
    async def guard_request(request: Request, call_next):
        t0, path = time.monotonic(), request.url.path
        cors = state.cross_site.cors_headers(request.headers.get("origin"))
        try:
            if request.method == "OPTIONS" and cors:
                return Response(status_code=204, headers=cors)
            state.cross_site.check(request.method, path, request.headers)
            _authorize(state, request)
            if _content_length(request) > state.max_body_bytes:
                raise P.ApiError(413, f"the request body is over {state.max_body_bytes} bytes")
            response = await call_next(request)
        except P.ApiError as e:
            response = error_response(e, path)
        response.headers.update(cors)
        request.state.t0 = t0
        if not getattr(request.state, "streaming", False):       # a stream logs itself when it ends
            _access_log(state, request, response.status_code, time.monotonic() - t0)
        return response

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        return error_response(e, request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(P.ApiError(e.status_code, what.get(e.status_code, str(e.detail)),
                                         code="not_found" if e.status_code == 404 else None), request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(P.ApiError(500, f"internal error ({type(e).__name__})", kind="server_error"),
                              request.url.path)

    _routes(app, state)
    return app


def error_response(e: P.ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error shape, or Anthropic's on its routes."""
    body = anthropic.anthropic_error(e) if path.startswith("/v1/messages") else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _access_log(state: ServerState, request: Request, status: int, seconds: float) -> None:
    """One line per request; every status is also counted for /metrics."""
    usage = getattr(request.state, "usage", None) or (0, 0)
    polled = request.method == "GET" and status < 400 and (request.url.path in POLLED or
                                                            request.url.path.startswith("/static/"))
    (access.debug if polled else access.info)('%s %s %d prompt=%d completion=%d %.0fms', request.method,
                                               request.url.path, status, usage[0], usage[1], seconds * 1000)
    state.metrics.http(request.url.path, status)


def _content_length(request: Request) -> int:
    try:
        return int(request.headers.get("content-length") or 0)
    except ValueError:
        raise P.ApiError(400, "the Content-Length header is not a number") from None


def _authorize(state: ServerState, request: Request) -> None:
    if not state.api_key or request.url.path in OPEN_PATHS or request.url.path.startswith("/static/"):
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise P.ApiError(401, "a valid API key is required (Authorization: Bearer ..., or x-api-key)",
                         kind="authentication_error", code="invalid_api_key")


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        if state.down:
            return JSONResponse({"status": "failed", "message": state.down}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        plan = state.engine.plan
        check = {"status": plan.serve_status, "message": plan.serve_message} if plan else {"status": "OK"}
        return {"status": "ok", "serve_check": check}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_entry(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise P.ApiError(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                             param="model", code="model_not_found")
        return _model_entry(state)

    @app.get("/props")
    async def props():
        """llama.cpp's server properties: agent clients read the context length here."""
        _ready(state)
        return {"n_ctx": state.engine.cfg.ctx, "model_alias": state.model_name, "build_info": f"moefit {__version__}",
                "default_generation_settings": {"n_ctx": state.engine.cfg.ctx},
                "total_slots": len(state.engine.sessions)}

    @app.get("/version")
    async def version():
        return {"version": __version__, "name": "moefit"}

    @app.get("/v1/status")
    async def status():
        return _status(state)

    @app.get("/v1/history")
    async def history():
        """This configuration's start history (the page's table)."""
        from moefit.ops.history import HistoryError, contract_row
        start = state.start
        if start is None or start.history is None:
            return {"starts": []}
        try:
            return {"starts": [contract_row(r) for r in start.history.rows(start.config_hash, last=20)]}
        except HistoryError as e:
            raise P.ApiError(503, str(e).split(": ", 1)[-1], kind="server_error") from None

    @app.get("/metrics")
    async def metrics():
        _ready(state)
        free = _free_bytes(state)
        return PlainTextResponse(state.metrics.render(state.engine, state.worker, state.guard, free))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = P.parse(P.ChatRequest, await _body(state, request))
        return await _serve(state, request, answer_runs(state, ChatRun, [req]))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse(P.CompletionRequest, await _body(state, request))
        return await _serve(state, request, answer_runs(state, CompletionRun, [req.one(p) for p in req.prompts()]))

    @app.post("/v1/responses")
    async def respond(request: Request):
        return await _serve(state, request, [responses.ResponsesRun(state, responses.parse(await _body(state, request)))])

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _serve(state, request, [anthropic.MessagesRun(state, anthropic.parse(await _body(state, request)))])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        _ready(state)
        req = anthropic.parse(await _body(state, request), anthropic.CountRequest)
        return {"input_tokens": len(anthropic.MessagesRun(state, req).prompt_ids())}

    @app.get("/favicon.ico")
    async def favicon():
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/")
    async def page():
        index = STATIC / "index.html"
        if not index.exists():
            return PlainTextResponse("moefit is running; the API is under /v1")
        return FileResponse(index)

    if STATIC.exists():
        from fastapi.staticfiles import StaticFiles
        app.mount("/static", StaticFiles(directory=STATIC), name="static")


async def _body(state: ServerState, request: Request) -> bytes:
    body = await request.body()
    if len(body) > state.max_body_bytes:
        raise P.ApiError(413, f"the request body is over {state.max_body_bytes} bytes")
    return body


def merge_choices(runs: list, answers: list[dict]) -> dict:
    """One answer from its choices' answers (each run's response holds its own choice)."""
    out = dict(answers[0])
    out["choices"] = [choice for a in answers for choice in a["choices"]]
    out["usage"] = runs[0].usage()
    return out


def _usage_pair(runs: list, job) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer for its access-log line."""
    made = sum(len(r.done.stats.generated) for r in runs if r.done)
    return (runs[0].usage()["prompt_tokens"] if len(runs) > 1 else len(job.prompt)), made


def sample_cache(state: ServerState) -> None:
    """One point of the page's hit-rate chart (the server keeps the last 400)."""
    state.samples.append({"time": time.time(), "hit_rate": state.engine.cache.hit_rate(),
                          "slots": state.engine.cached_experts()})


def _model_entry(state: ServerState) -> dict:
    ctx = state.engine.cfg.ctx if state.ready else None
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "moefit",
            "max_model_len": ctx, "context_length": ctx}


def _ready(state: ServerState) -> None:
    if not state.ready:
        raise P.ApiError(503, "the model is still loading", kind="server_error", code="loading",
                         headers={"Retry-After": "5"})


def _free_bytes(state: ServerState) -> int | None:
    try:
        return state.engine.free_device_bytes()
    except DeviceUnavailable:
        return None


async def _serve(state: ServerState, request: Request, runs: list) -> Response:
    """An answer's runs (its choices) one after another: every prompt checked first, so a bad one
    is a 400 before anything runs; a client that goes away stops the rest."""
    _ready(state)
    for run in runs:
        run.check_model()
        run.prepare()
    loop = asyncio.get_running_loop()
    job = runs[0].submit(loop)
    request.state.usage = (len(job.prompt), 0)
    if runs[0].req.stream:
        request.state.streaming = True
        return StreamingResponse(_sse(state, runs, job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    answers = [await runs[0].collect(job, request)]
    for run in runs[1:]:
        if job.cancelled.is_set():
            break
        job = run.submit(loop, admitted=True)
        answers.append(await run.collect(job, request))
    if len(runs) == 1:
        return answers[0]
    request.state.usage = _usage_pair(runs, job)
    return merge_choices(runs, answers)


async def _sse(state: ServerState, runs: list, job, request: Request):
    """Server-sent events in the runs' protocol, choice after choice; comments keep the connection
    alive during a long prefill. A client that goes away cancels the job (the engine stops within
    one step). The access-log line is written when the stream ends, with its token counts."""
    run = runs[0]
    try:
        for k, run in enumerate(runs):
            if k:
                try:
                    job = run.submit(asyncio.get_running_loop(), admitted=True)
                except P.ApiError as e:               # the server began to stop between two choices
                    yield run.sse(e.body())
                    break
            async for event in _job_events(state, run, job):
                yield event
            if run.done is None:                     # failed: its error event was sent
                break
        for chunk in run.stream_chunks(None):
            yield run.sse(chunk)
        yield run.sse_end()
    finally:
        job.cancelled.set()
        request.state.usage = _usage_pair(runs, job)
        _access_log(state, request, 200, time.monotonic() - getattr(request.state, "t0", time.monotonic()))


async def _job_events(state: ServerState, run, job):
    """One job's events as the run's server-sent events, keep-alive comments between, to its end."""
    while (item := await _next_event(state, job)) is not None:
        if item is KEEP_ALIVE:
            yield item
            continue
        for chunk in run.stream_chunks(item):
            yield run.sse(chunk)


KEEP_ALIVE = ": keep-alive\n\n"


async def _next_event(state: ServerState, job):
    try:
        return await asyncio.wait_for(job.events.get(), timeout=state.keepalive_s)
    except asyncio.TimeoutError:
        return KEEP_ALIVE


def _status(state: ServerState) -> dict:
    from moefit.runtime.report import status_json
    if not state.ready:
        return {"status": "failed" if state.load_error else "loading", "message": state.load_error,
                "uptime_s": time.time() - state.started}
    if state.down:
        return {"status": "failed", "message": state.down, "uptime_s": time.time() - state.started}
    out = status_json(state.engine)
    out["uptime_s"] = time.time() - state.started
    out["model"] = state.model_name
    out["guard"] = {"warnings": state.guard.warnings, "resizes": state.guard.resizes,
                    "floor_bytes": state.guard.floor_bytes,
                    "events": [e.__dict__ for e in state.guard.events[-50:]]}
    out["queue"] = {"running": len(state.worker.running), "waiting": len(state.worker.waiting),
                    "max": state.worker.max_queue}
    out["recent_requests"] = [r.__dict__ for r in list(state.worker.recent)[-50:]]
    out["kv_cache"] = {"tokens": state.engine.context_tokens(), "ctx": state.engine.cfg.ctx}
    out["cache_samples"] = list(state.samples)
    out["start"] = state.start.summary() if state.start else None
    return out
