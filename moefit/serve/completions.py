"""One request of /v1/chat/completions or /v1/completions: prompt, limits, and the
response (whole, or as stream chunks)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import jinja2

from moefit.serve import protocol as P
from moefit.serve.toolparse import OutputParser, split_final
from moefit.serve.worker import Done, Job


def context_message(ctx: int, prompt: int, wanted: int | None, field: str) -> str:
    """OpenAI's and vLLM's wording, which agent clients parse to learn the context length."""
    asked = prompt + (wanted or 0)
    where = "messages" if field == "messages" else "prompt"
    return (f"This model's maximum context length is {ctx} tokens. However, you requested {asked} tokens "
            f"({prompt} in the {where}, {wanted or 0} in the completion). Please reduce the length of the "
            f"{where} or completion.")


async def _disconnect(request) -> None:
    """Returns when the client hangs up; cancels nothing by itself."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    object_name = ""
    chunk_name = ""

    def __init__(self, state, req):
        self.state, self.req = state, req
        self.engine = state.engine
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.done: Done | None = None
        self.sent_role = False
        self.prompt_tokens = 0
        self.prompt: list[int] | None = None      # prepare()'s: the prompt's tokens and the sampling
        self.params = None
        self.logprobs: list = []                   # TokenLogprob of each generated token, when asked
        self.index = 0                             # this run's choice in the answer
        self.choices: list = [self]                # the answer's runs, one a choice (answer_runs)
        self.counts_prompt = True                  # the first choice of its prompt: usage counts the prompt

    def check_model(self) -> None:
        if self.req.model and self.req.model != self.state.model_name:
            raise P.ApiError(404, f"model {self.req.model!r} does not exist; this server serves "
                             f"{self.state.model_name!r}", param="model", code="model_not_found")

    def max_tokens(self) -> int | None:
        return self.req.max_tokens

    def grammar(self) -> str | None:
        """The grammar the output must follow (constrained decoding), or None."""
        return None

    def prepare(self) -> None:
        """The prompt's tokens, checked against the context, and the sampling: a 400 before anything runs."""
        prompt = self.prompt_ids()
        self.prompt_tokens = len(prompt)
        ctx = self.engine.cfg.ctx
        wanted = self.max_tokens()
        if len(prompt) >= ctx or (wanted is not None and len(prompt) + wanted > ctx):
            raise P.ApiError(400, context_message(ctx, len(prompt), wanted, self.prompt_field),
                             param=self.prompt_field if len(prompt) >= ctx else "max_tokens",
                             code="context_length_exceeded")
        self.prompt = prompt
        vocab = self.engine.pack.model.vocab_size
        self.params = P.sampling(self.req, wanted or ctx - len(prompt), self.grammar(), vocab)

    def submit(self, loop: asyncio.AbstractEventLoop, admitted: bool = False) -> Job:
        """This run's job, queued (admitted: the request's first choice already was; Worker.submit)."""
        if self.prompt is None:
            self.prepare()
        job = Job(self.prompt, self.params, loop)
        try:
            self.state.worker.submit(job, admitted)
        except P.ApiError as e:
            self.state.metrics.rejected(e.status)
            raise
        return job

    async def collect(self, job: Job, request):
        """Wait for the whole answer; a client that leaves cancels the job. (A task waits on
        the connection for its disconnect: Starlette's is_disconnected() polls with an
        immediate cancel and never sees one through the middleware.)"""
        items = []
        gone = asyncio.ensure_future(_disconnect(request))
        gone.add_done_callback(lambda f: f.cancelled() or job.cancelled.set())
        try:
            while (item := await job.events.get()) is not None:
                if isinstance(item, P.ApiError):
                    raise item
                items.append(item)
        finally:
            gone.cancel()
        self.done = next(i for i in items if isinstance(i, Done))
        request.state.usage = (self.done.stats.prompt_tokens, len(self.done.stats.generated))
        events = [i for i in items if not isinstance(i, Done)]
        self.logprobs = [e.logprob for e in events if e.logprob is not None]
        return self.response("".join(e.text for e in events), self.done.finish_reason)

    def usage(self) -> dict:
        """The answer's usage: every choice's completion, each prompt once (as OpenAI counts n > 1)."""
        ran = [r.done.stats for r in self.choices if r.done]
        prompts = [r.done.stats for r in self.choices if r.done and r.counts_prompt]
        prompt, made = sum(s.prompt_tokens for s in prompts), sum(len(s.generated) for s in ran)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompts)}}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.chunk_name, "created": self.created, "model": self.state.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def sse(self, chunk: dict) -> str:
        """One server-sent event (OpenAI: data lines, closed by [DONE])."""
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def sse_end(self) -> str:
        return "data: [DONE]\n\n"

    def stream_chunks(self, item) -> list[dict]:
        if isinstance(item, P.ApiError):
            return [item.body()]
        if isinstance(item, Done):
            self.done = item
            return []
        if item is None:
            opts = self.req.stream_options
            return [self.chunk([], self.usage())] if opts and opts.include_usage and self.done else []
        return self.event_chunks(item)


class ChatRun(_Run):
    prefix, chunk_name, prompt_field = "chatcmpl", "chat.completion.chunk", "messages"

    def __init__(self, state, req):
        super().__init__(state, req)
        self.parser = OutputParser(req.tools)
        self.tool_index = 0

    def max_tokens(self) -> int | None:
        return self.req.max_completion_tokens or self.req.max_tokens

    def grammar(self) -> str | None:
        from moefit.serve import constrain
        return constrain.chat_grammar(self.req, self.engine.codec)

    def prompt_ids(self) -> list[int]:
        tools = None if self.req.tool_choice == "none" else self.req.tools
        try:
            text = self.engine.codec.render_chat(P.message_dicts(self.req.messages), tools=tools,
                                                 **self.req.template_kwargs())
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise P.ApiError(400, f"messages: the chat template rejected them ({e})", param="messages") from None
        return self.engine.codec.encode(text)

    def response(self, text: str, finish: str) -> dict:
        content, reasoning, calls = split_final(text, self.req.tools)
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": self.index, "message": message, "finish_reason": finish}
        if self.req.logprobs:
            choice["logprobs"] = {"content": [self.chat_logprob(lp) for lp in self.logprobs]}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.model_name,
                "choices": [choice], "usage": self.usage()}

    def chat_logprob(self, lp) -> dict:
        """OpenAI chat's entry for one token: text, bytes, logprob and the top alternatives."""
        entry = lambda tok, value: {"token": (t := self.engine.codec.decode([tok])), "logprob": value,  # noqa: E731
                                    "bytes": list(t.encode("utf-8"))}
        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

    def event_chunks(self, event) -> list[dict]:
        items = self.parser.feed(event.text) + (self.parser.finish() if event.finish_reason else [])
        chunks = []
        if not self.sent_role:
            self.sent_role = True
            chunks.append(self.chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]))
        for kind, value in items:
            chunks.append(self.chunk([{"index": self.index, "delta": self._delta(kind, value), "finish_reason": None}]))
        if event.logprob is not None:               # on this event's last delta, or an empty delta
            if not items:
                chunks.append(self.chunk([{"index": self.index, "delta": {}, "finish_reason": None}]))
            chunks[-1]["choices"][0]["logprobs"] = {"content": [self.chat_logprob(event.logprob)]}
        if event.finish_reason:
            finish = "tool_calls" if self.parser.calls and event.finish_reason == "stop" else event.finish_reason
            chunks.append(self.chunk([{"index": self.index, "delta": {}, "finish_reason": finish}]))
        return chunks


    def _delta(self, kind: str, value) -> dict:
        if kind == "content":
            return {"content": value}
        if kind == "reasoning":
            return {"reasoning_content": value}
        self.tool_index += 1
        return {"tool_calls": [{"index": self.tool_index - 1, **value}]}


class CompletionRun(_Run):
    prefix, chunk_name, prompt_field = "cmpl", "text_completion", "prompt"

    def prompt_ids(self) -> list[int]:
        prompt = self.req.prompt
        if not prompt:
            raise P.ApiError(400, "prompt: must not be empty", param="prompt")
        if isinstance(prompt, list):
            vocab = self.engine.pack.model.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise P.ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        return self.engine.codec.encode(prompt)

    def response(self, text: str, finish: str) -> dict:
        if self.req.echo and isinstance(self.req.prompt, str):
            text = self.req.prompt + text
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.model_name,
                "choices": [{"index": self.index, "text": text, "finish_reason": finish,
                             "logprobs": self.completion_logprobs(self.logprobs, len(text) - len(self._generated(text)))}],
                "usage": self.usage()}

    def _generated(self, text: str) -> str:
        return text[len(self.req.prompt):] if self.req.echo and isinstance(self.req.prompt, str) else text

    def completion_logprobs(self, lps: list, offset: int = 0) -> dict | None:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        if self.req.logprobs is None:
            return None
        tokens = [self.engine.codec.decode([lp.token]) for lp in lps]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "text_offset": offsets,
                "top_logprobs": [{self.engine.codec.decode([t]): v for t, v in lp.top} for lp in lps]}

    def event_chunks(self, event) -> list[dict]:
        lps = [event.logprob] if event.logprob is not None else []
        return [self.chunk([{"index": self.index, "text": event.text, "finish_reason": event.finish_reason,
                             "logprobs": self.completion_logprobs(lps)}])]


def answer_runs(state, run_class, requests: list) -> list:
    """The runs of one answer: each request's (a completions request's prompt's) n choices in
    turn, as OpenAI orders them, choice i under the first run's id. The engine holds one sequence,
    so the choices run one after another; the same prompt again reuses its state, so every choice
    after a prompt's first costs only its decode."""
    runs = []
    for req in requests:
        for i, choice in enumerate(req.choices()):
            run = run_class(state, choice)
            run.counts_prompt = i == 0
            runs.append(run)
    for i, run in enumerate(runs):
        run.index, run.id, run.created, run.choices = i, runs[0].id, runs[0].created, runs
    return runs
