"""Tokenizer, chat template and incremental detokenisation.

The chat template renders with the same Jinja settings transformers uses (trim_blocks,
lstrip_blocks, loopcontrols, a tojson that keeps non-ASCII), so prompts match
`apply_chat_template` token for token.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from moefit.errors import PackError


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _template_env() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _tool_call_style(template: str | None) -> str:
    """How a chat template teaches tool calls (serve/toolparse.py): Qwen's JSON ("json"), GLM-4.5's
    <arg_key> / <arg_value> pairs a line each ("glm"), or GLM-4.7's with nothing between them
    ("glm-compact")."""
    if not template or "<arg_key>" not in template:
        return "json"
    return "glm" if "</arg_value>\n" in template else "glm-compact"


class TextCodec:
    """Usage: codec = TextCodec.load(pack.tokenizer_dir); ids = codec.encode("hi")"""

    def __init__(self, tokenizer: Tokenizer, config: dict, template: str | None):
        self.tokenizer = tokenizer
        self.config = config
        self.template = _template_env().from_string(template) if template else None
        self.tool_call_style = _tool_call_style(template)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

    @staticmethod
    def load(directory: Path) -> "TextCodec":
        directory = Path(directory)
        try:
            tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise PackError(f"{directory / 'tokenizer.json'}: cannot be read ({e})") from None
        cfg_file = directory / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = config.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        return TextCodec(tok, config, template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return self.tokenizer.token_to_id(text) if text else None

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **extra) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template; use a plain completion prompt")
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half of a
    multi-byte character (the decoder shows those as U+FFFD until complete)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0            # ids before this are settled text
        self.read = 0              # ids before this have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        full_text = self.codec.decode(self.ids[self.prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full_text[len(prefix_text):]


class StopMatcher:
    """Holds back text that could be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, stopped)."""
        self.pending += text
        for s in self.stops:
            at = self.pending.find(s)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
