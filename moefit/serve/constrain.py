"""What a request constrains its output to, as an llguidance grammar (runtime/grammar.py):
`response_format` json_object / json_schema, and `tool_choice` "required" or a named function
(the output is then one tool call whose arguments validate against that tool's schema)."""

from __future__ import annotations

from moefit.serve.protocol import ApiError


def chat_grammar(req, codec) -> str | None:
    from moefit.runtime import grammar as G
    tools = _forced_tools(req)
    if tools and codec.tool_call_style.startswith("glm"):
        return G.glm_tool_call_grammar(tools, {t: _tag(codec, t) for t in G.GLM_TAGS},
                                       lines=codec.tool_call_style == "glm")
    if tools:
        return G.tool_call_grammar(tools, _tag(codec, "<tool_call>"), _tag(codec, "</tool_call>"))
    fmt = req.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return G.json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema: a JSON schema object is required",
                           param="response_format")
        return G.json_schema_grammar(schema)
    if kind != "text":
        raise ApiError(400, f"response_format: type {kind!r} is not supported (text, json_object, json_schema)",
                       param="response_format")
    return None


def _forced_tools(req) -> list[dict]:
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return []
    tools = req.tools or []
    if not tools:
        raise ApiError(400, "tool_choice: forcing a tool call needs tools", param="tool_choice")
    if choice == "required":
        return tools
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t.get("function", {}).get("name") == name]
    if not chosen:
        raise ApiError(400, f"tool_choice: no tool named {name!r} among the tools", param="tool_choice")
    return chosen


def _tag(codec, text: str) -> str:
    """A tag as the grammar spells it: the special token's id when the tokenizer has one."""
    token = codec.token_id(text)
    return f"<[{token}]>" if token is not None else '"' + text.replace('"', '\\"') + '"'
