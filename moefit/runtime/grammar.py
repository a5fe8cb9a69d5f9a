"""Constrained decoding with llguidance: a grammar (JSON schema, Lark) turned into a mask over
the vocabulary before each draw, so the output is in the grammar by construction.

    tok = GrammarTokenizer.of(engine)                  # built once per engine (~1 s)
    constraint = Constraint(tok, json_schema_grammar({"type": "object"}))
    logits = constraint.mask(logits); ...; constraint.accept(token)

The sampler owns one per request: the mask comes before penalties and temperature, and
speculative verification draws every position through the same sampler, so a draft is kept
only if the grammar allowed it (lossless). llguidance is optional: a request that needs a
grammar without it installed is refused with a clear error.
"""

from __future__ import annotations

import json

import torch

from moefit.errors import UsageError


def _llguidance():
    try:
        import llguidance
        return llguidance
    except ImportError:
        raise UsageError("constrained decoding (response_format, tool_choice) needs the llguidance package: "
                         "pip install llguidance") from None


class GrammarTokenizer:
    """llguidance's view of the engine's tokenizer, cached on the engine."""

    def __init__(self, codec, vocab_size: int, eos_ids: set[int]):
        self.vocab_size = vocab_size
        self.tok = _llguidance().LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab_size,
                                             eos_token=sorted(eos_ids))

    @staticmethod
    def of(engine) -> "GrammarTokenizer":
        if getattr(engine, "_grammar_tokenizer", None) is None:
            engine._grammar_tokenizer = GrammarTokenizer(engine.codec, engine.pack.model.vocab_size, engine.eos_ids)
        return engine._grammar_tokenizer


class Constraint:
    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        lg = _llguidance()
        self.matcher = lg.LLMatcher(tokenizer.tok, grammar, log_level=0)
        if self.matcher.is_error():
            raise UsageError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.vocab = tokenizer.vocab_size

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids here set to -inf."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
        bits = allocate_token_bitmask(1, self.vocab)
        fill_next_token_bitmask(self.matcher, bits)
        allowed = ((bits[0].repeat_interleave(32) >> torch.arange(32, dtype=torch.int32).repeat(bits.shape[1])) & 1)
        return logits.masked_fill(allowed[:logits.shape[-1]] == 0, float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise UsageError(f"the grammar rejected token {token}: {self.matcher.get_error()}")


GLM_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
COMPACT = {"x-guidance": {"whitespace_flexible": False}}   # JSON without free whitespace: a model cannot
                                                          # pad it forever (measured on the tiny test model)


def json_schema_grammar(schema: dict) -> str:
    return _llguidance().grammar_from("json_schema", json.dumps({**schema, **COMPACT}))


def tool_call_grammar(tools: list[dict], open_tag: str, close_tag: str) -> str:
    """The whole output is one Qwen / Hermes tool call to one of `tools` (OpenAI function
    tools), its arguments valid against that tool's schema. open_tag / close_tag are the
    grammar's spelling of <tool_call> and </tool_call> (a special token or the text)."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **COMPACT}
    lark = f'start: {open_tag} "\\n" call "\\n" {close_tag}\ncall: %json {json.dumps(schema)}\n'
    return _llguidance().grammar_from("lark", lark)


def glm_tool_call_grammar(tools: list[dict], tags: dict[str, str], lines: bool = True) -> str:
    """The whole output is one GLM tool call (serve/toolparse.py) to one of `tools`: its name,
    then each parameter of its schema in the schema's order, the required ones always, each
    value a string as it is (an enum's strings: one of them) or JSON valid against its schema;
    so the call's arguments are valid by construction. `tags` spell <tool_call>, </tool_call>,
    <arg_key>, </arg_key>, <arg_value> and </arg_value> as the grammar must (special tokens);
    `lines`: GLM-4.5's newline after the name and each key and value, else GLM-4.7's none."""
    rules, calls, nl = [], [], '"\\n"' if lines else ""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") or {}
        required, args = set(params.get("required") or ()), []
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            value, lexemes = _glm_value(schema, f"VALUE_{i}_{j}")
            rules += lexemes
            rules.append(f'arg_{i}_{j}: {tags["<arg_key>"]} {json.dumps(key)} {tags["</arg_key>"]} {nl} '
                         f'{tags["<arg_value>"]} {value} {tags["</arg_value>"]} {nl}')
            args.append(f"arg_{i}_{j}" if key in required else f"arg_{i}_{j}?")
        rules.append(f'call_{i}: {json.dumps(fn["name"])} {nl} {" ".join(args)}')
        calls.append(f"call_{i}")
    lark = f'start: {tags["<tool_call>"]} ({" | ".join(calls)}) {tags["</tool_call>"]}\n' + "\n".join(rules) + "\n"
    return _llguidance().grammar_from("lark", lark)


def _glm_value(schema, name: str) -> tuple[str, list[str]]:
    """A GLM argument value, and the lexemes it needs: a string as it is (no "<": the tags follow
    it; an enum's strings: one of them; its minLength / maxLength and pattern kept), else JSON."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") != "string" or not all(isinstance(v, str) for v in schema.get("enum", [])):
        return f"%json {json.dumps({**schema, **COMPACT})}", []
    if schema.get("enum"):
        return f'({" | ".join(json.dumps(v) for v in schema["enum"])})', []
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    plain = "/[^<]*/" if lo is None and hi is None else f"/[^<]{{{int(lo or 0)},{'' if hi is None else int(hi)}}}/"
    if not isinstance(schema.get("pattern"), str):
        return plain, []
    return name, [f"{name}: {plain} & /{_searched(schema['pattern'])}/"]


def _searched(pattern: str) -> str:
    """A JSON schema's pattern (ECMA, found anywhere unless anchored) as a regex the whole value
    must match: llguidance's spelling of it (\\d and \\w in ASCII, as JSON schema's), a side
    not anchored by ^ or $ padded with anything."""
    rx = _llguidance().regex_to_lark(pattern, "dw")
    head, rx = ("", rx[1:]) if rx.startswith("^") else ("(?s:.*)", rx)
    tail, rx = ("", rx[:-1]) if rx.endswith("$") and not rx.endswith("\\$") else ("(?s:.*)", rx)
    return f"{head}(?:{rx}){tail}"
