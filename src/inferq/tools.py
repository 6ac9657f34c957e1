"""Tools and structured output in a request's ``params``: OpenAI's shapes, checked.

A request's ``params`` go to the model server as they are (the ``openai`` backend adds
them to the body of ``/v1/chat/completions``; llama.cpp started with ``--jinja``, vLLM
and TGI read them). These fields change what the server must parse, so a wrong shape
is refused at intake, before anything reaches Redis, naming the field and the limit,
rather than failing on a worker after a trip through the queue:

- ``tools``: a list of 1..:data:`MAX_TOOLS` ``{"type": "function", "function": {"name",
  "description"?, "parameters"?, "strict"?}}``, names unique and of
  :data:`TOOL_NAME` (OpenAI's rule), at most :data:`MAX_TOOLS_BYTES` of JSON.
- ``tool_choice``: ``none``, ``auto``, ``required``, or ``{"type": "function",
  "function": {"name"}}`` naming one of ``tools`` (any but ``none`` needs ``tools``).
- ``parallel_tool_calls``: true or false.
- ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?,
  "description"?}}``.

Pure functions; every refusal is an :class:`~inferq.errors.InvalidRequest` whose field
is ``params.<name>...`` with list indices as path parts (``params.tools.1.function.name``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from inferq.errors import InvalidRequest

#: Most tools one request may declare: OpenAI's limit (its API refuses a 129th).
MAX_TOOLS = 128
#: Largest JSON encoding of ``tools``, bytes. Tool definitions with their JSON schemas
#: run to a few KiB each (a 20-tool agent's set measures 10-30 KiB), more than the
#: 16 KiB of the other parameters; the server renders all of it into the prompt, so
#: its tokens are counted there too (:func:`tools_text`).
MAX_TOOLS_BYTES = 64 * 1024
#: A function's (and a JSON schema's) name: OpenAI's rule.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: ``tool_choice`` as a string.
TOOL_CHOICES = ("none", "auto", "required")
#: ``response_format.type``.
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_tools(params: Mapping[str, Any]) -> None:
    """Refuse ``tools``, ``tool_choice``, ``parallel_tool_calls`` or ``response_format``
    of the wrong shape (see the module docstring); absent or None fields pass.

    Raises:
        InvalidRequest: names the field (``params.tools.0.function.name``) and what it
            must be.
    """
    names = _tools(params.get("tools"))
    _tool_choice(params.get("tool_choice"), names)
    parallel = params.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            "params.parallel_tool_calls", f"must be true or false, got {_kind(parallel)}"
        )
    _response_format(params.get("response_format"))


def tools_bytes(tools: Any) -> int:
    """Bytes of the JSON encoding of ``tools`` (UTF-8, as intake measures ``params``).

    Raises:
        InvalidRequest: ``params.tools`` does not encode as JSON.
    """
    try:
        return len(json.dumps(tools, allow_nan=False, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidRequest("params.tools", f"must be JSON-serializable: {exc}") from None


def tools_text(params: Mapping[str, Any]) -> str:
    """The text of ``tools`` the model server renders into the prompt (its JSON), for
    the prompt's token count; ``""`` without tools."""
    tools = params.get("tools")
    if not tools:
        return ""
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


def _tools(tools: Any) -> set[str]:
    """The names of the declared functions (empty without tools)."""
    if tools is None:
        return set()
    where = "params.tools"
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest(where, f"must be a non-empty list of tools, got {_kind(tools)}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(where, f"{len(tools)} tools exceeds the limit of {MAX_TOOLS}")
    size = tools_bytes(tools)
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest(
            where, f"{size} bytes of JSON exceeds the limit of {MAX_TOOLS_BYTES} bytes"
        )
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}.{i}"
        if not isinstance(tool, Mapping):
            raise InvalidRequest(at, f"must be an object, got {_kind(tool)}")
        if tool.get("type") != "function":
            raise InvalidRequest(f"{at}.type", f"must be 'function', got {_kind(tool.get('type'))}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequest(f"{at}.function", f"must be an object, got {_kind(function)}")
        name = _name(function.get("name"), f"{at}.function.name")
        if name in names:
            raise InvalidRequest(f"{at}.function.name", f"{name!r} is declared twice")
        names.add(name)
        _optional(function, "description", str, f"{at}.function", "a string")
        _optional(function, "parameters", Mapping, f"{at}.function", "an object (a JSON schema)")
        _optional(function, "strict", bool, f"{at}.function", "true or false")
    return names


def _tool_choice(choice: Any, names: set[str]) -> None:
    where = "params.tool_choice"
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequest(
                where,
                f"must be one of {', '.join(TOOL_CHOICES)} or a function, got {_kind(choice)}",
            )
        if choice != "none" and not names:
            raise InvalidRequest(where, f"{choice!r} needs tools to choose from")
        return
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        raise InvalidRequest(
            where,
            f"must be one of {', '.join(TOOL_CHOICES)} or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {_kind(choice)}',
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequest(f"{where}.function.name", f"must be a string, got {_kind(name)}")
    if name not in names:
        declared = ", ".join(sorted(names)) or "none"
        raise InvalidRequest(
            f"{where}.function.name", f"{_kind(name)} is not a declared tool (declared: {declared})"
        )


def _response_format(fmt: Any) -> None:
    where = "params.response_format"
    if fmt is None:
        return
    if not isinstance(fmt, Mapping):
        raise InvalidRequest(where, f"must be an object, got {_kind(fmt)}")
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"{where}.type", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {_kind(kind)}"
        )
    if kind != "json_schema":
        return
    schema = fmt.get("json_schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{where}.json_schema", f"must be an object, got {_kind(schema)}")
    _name(schema.get("name"), f"{where}.json_schema.name")
    _optional(schema, "schema", Mapping, f"{where}.json_schema", "an object (a JSON schema)")
    _optional(schema, "strict", bool, f"{where}.json_schema", "true or false")
    _optional(schema, "description", str, f"{where}.json_schema", "a string")


def _optional(obj: Mapping[str, Any], name: str, kind: Any, at: str, what: str) -> None:
    value = obj.get(name)
    if value is None:
        return
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidRequest(f"{at}.{name}", f"must be {what}, got {_kind(value)}")


def _kind(value: Any) -> str:
    """A caller's value, short: a short string or number as itself, else its type."""
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    if isinstance(value, bool | int | float) or value is None:
        return repr(value) if value is not None else "null"
    return type(value).__name__


def _name(value: object, field: str) -> str:
    """A function or schema name as OpenAI allows it (``TOOL_NAME``).

    Raises:
        InvalidRequest: (``field``) anything else.
    """
    if not isinstance(value, str) or not TOOL_NAME.fullmatch(value):
        raise InvalidRequest(field, f"must be 1-64 letters, digits, '_' or '-', got {_kind(value)}")
    return value
