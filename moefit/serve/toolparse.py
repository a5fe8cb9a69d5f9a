"""Split model text into content, reasoning (<think>...</think>) and tool calls
(Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>), incrementally,
so streams carry each as its own delta. Text that only might start a tag is held back."""

from __future__ import annotations

import json
import uuid

TAGS = {"<think>": "reasoning", "</think>": "content", "<tool_call>": "tool", "</tool_call>": "content"}


class OutputParser:
    """Usage: p = OutputParser(); for kind, value in p.feed(delta): ...; p.finish()"""

    def __init__(self):
        self.mode = "content"
        self.buffer = ""
        self.tool_text = ""
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        out = []
        while self.buffer:
            at, tag = self._next_tag()
            if tag is None:
                keep = _partial_tag_suffix(self.buffer)
                self._emit(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._emit(self.buffer[:at], out)
            self.buffer = self.buffer[at + len(tag):]
            self._switch(tag, out)
        return out

    def finish(self) -> list[tuple[str, object]]:
        out = []
        self._emit(self.buffer, out)
        self.buffer = ""
        if self.mode == "tool" and self.tool_text:
            out.append(("content", "<tool_call>" + self.tool_text))        # unterminated: lose nothing
        return out

    def _next_tag(self) -> tuple[int, str | None]:
        hits = [(self.buffer.find(t), t) for t in TAGS if t in self.buffer]
        return min(hits) if hits else (-1, None)

    def _emit(self, text: str, out: list) -> None:
        if not text:
            return
        if self.mode == "tool":
            self.tool_text += text
        elif out and out[-1][0] == self.mode:
            out[-1] = (self.mode, out[-1][1] + text)
        else:
            out.append((self.mode, text))

    def _switch(self, tag: str, out: list) -> None:
        if tag == "</tool_call>" and self.mode == "tool":
            out.append(self._tool_call(self.tool_text))
            self.tool_text = ""
        self.mode = TAGS[tag]

    def _tool_call(self, body: str) -> tuple[str, object]:
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return ("content", f"<tool_call>{body}</tool_call>")
        self.calls += 1
        return ("tool_call", {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": name, "arguments": args if isinstance(args, str)
                                           else json.dumps(args, ensure_ascii=False)}})


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest suffix of text that begins some tag."""
    best = 0
    for tag in TAGS:
        for n in range(1, len(tag)):
            if text.endswith(tag[:n]):
                best = max(best, n)
    return best


def split_final(text: str) -> tuple[str, str | None, list[dict]]:
    """(content, reasoning or None, tool calls) of a complete output."""
    parser = OutputParser()
    items = parser.feed(text) + parser.finish()
    content = "".join(v for k, v in items if k == "content")
    reasoning = "".join(v for k, v in items if k == "reasoning")
    calls = [v for k, v in items if k == "tool_call"]
    return content.strip() if reasoning or calls else content, reasoning.strip() or None, calls
