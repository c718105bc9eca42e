"""What goes into the chat template of a request with tools: the request's `tools` and `tool_choice` checked
(`check_tools`), the conversation's calls in the form templates read (`template_tool_calls`), and, for a template
that prints no tools, the tools in the system message with the Hermes call format and the conversation's calls and
results written in that format (`for_template`). What a template prints is found once per template (`support`).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

from localspec.server.openai import MAX_DEPTH, APIError, too_deep
from localspec.server.tool_calls import HERMES_CLOSE, HERMES_OPEN


def check_tools(tools, tool_choice) -> tuple[list[dict] | None, set[str]]:
    """The tools to give the template (None: no tools, or tool_choice "none") and their names. 400 for a malformed
    list or a tool_choice naming no given tool."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, set()
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                           param=f"tools[{i}]")
        names.append(f["name"])
    if tool_choice is None or tool_choice in ("auto", "required"):
        pass
    elif tool_choice == "none":
        return None, set()
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        wanted = tool_choice["function"].get("name")
        if wanted not in names:
            raise APIError(400, f"tool_choice names {wanted!r}, which is not among the tools", param="tool_choice")
    else:
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return [t if "type" in t else {"type": "function", **t} for t in tools], set(names)


def template_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them: the arguments as an object (templates print
    them with `| tojson`), not the JSON text OpenAI sends."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", param=where.split(".")[0].split("[")[0])
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise APIError(400, f"{where}[{j}] must be {{\"type\": \"function\", \"id\": ..., \"function\": "
                                "{\"name\": ..., \"arguments\": \"{...}\"}}", param=where.split("[")[0])
        args = f.get("arguments")
        place = f"{where}[{j}].function.arguments" if where.endswith("tool_calls") else f"{where}.arguments"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
                deep = too_deep(args)
            except ValueError:
                deep = False  # left as text: the template prints what it was given
            except RecursionError:
                deep = True
            if deep:  # the template and the walks over the prompt recurse per level
                raise APIError(400, f"{place} is nested more than {MAX_DEPTH} levels deep",
                               param=where.split(".")[0].split("[")[0])
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ templates that show no tools
# What a model whose template prints no tools is told (the Hermes / Qwen wording; its calls are read, and held to
# the schemas, as under a Hermes template). Unlike llama.cpp's generic format, which makes every answer a JSON
# object ({"response": ...} or {"tool_call": ...}), the answer stays free text until the model starts a call.
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_PROBE = "localspec_probe"


@dataclass(frozen=True)
class Support:
    """What a chat template prints: the request's tools, an assistant turn's calls, a tool turn's result, a system
    message."""
    tools: bool
    calls: bool
    results: bool
    system: bool


_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def support(tmpl) -> Support:
    """What `tmpl` (a ChatTemplate) prints, found once by rendering a conversation with marked names."""
    got = _SUPPORT.get(tmpl)
    if got is not None:
        return got

    def shows(msgs, needle, tools=None) -> bool:
        try:
            return needle in tmpl.render(msgs, True, tools)
        except Exception:  # a template that refuses the role or the fields: it does not print them
            return False

    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": _PROBE + "_tool", "description": "",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": _PROBE + "_call", "arguments": {}}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "name": _PROBE + "_call", "content": _PROBE + "_result"}
    got = _SUPPORT[tmpl] = Support(
        tools=shows([user], _PROBE + "_tool", [tool]), calls=shows([user, call], _PROBE + "_call", [tool]),
        results=shows([user, call, result], _PROBE + "_result", [tool]),
        system=shows([{"role": "system", "content": _PROBE + "_system"}, user], _PROBE + "_system"))
    return got


def hermes_calls(calls: list[dict]) -> str:
    """An assistant turn's calls (template_tool_calls' form) written as Hermes calls."""
    return "\n".join(f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                     + f"\n{HERMES_CLOSE}" for c in calls)


def for_template(msgs: list[dict], tools: list[dict] | None, tmpl) -> tuple[list[dict], bool]:
    """(the messages as `tmpl` can show them, whether the model is taught the Hermes call format here). A template
    that prints no tools gets them in the system message (TOOLS_PROMPT; in the first user message when it takes no
    system message); calls and results it does not print (all of them, when it prints no tools) are written into
    the text as Hermes calls and `<tool_response>` blocks (the results as a user turn), as the model was told."""
    if tmpl is None or (tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)):
        return msgs, False
    sup = support(tmpl)
    calls, results = sup.calls and sup.tools, sup.results and sup.tools  # no tool format: all of it as Hermes
    out: list[dict] = []
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls") and not calls:
            text = "\n".join(x for x in (m.get("content") or "", hermes_calls(m["tool_calls"])) if x)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool" and not results:
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("from_tool"):  # results of one turn's calls: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "from_tool": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "from_tool"} for m in out]
    taught = tools is not None and not sup.tools
    if taught:
        note = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note}
        elif sup.system:
            out.insert(0, {"role": "system", "content": note})
        else:
            i = next((j for j, m in enumerate(out) if m["role"] == "user"), None)
            if i is None:
                out.insert(0, {"role": "user", "content": note})
            else:
                out[i] = {**out[i], "content": f"{note}\n\n{out[i]['content']}"}
    return out, taught
