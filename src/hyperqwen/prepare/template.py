"""Step 5: harden the chat template against two things OpenAI clients send that templates reject.

* Tool-call arguments that are not an object. vLLM parses each assistant tool call's
  `arguments` JSON string before rendering, so a client replaying `"[1, 2]"` hands the template
  a list, and the Qwen templates' `tool_call.arguments|items` (or `.items()`) fails on it: the
  whole request fails. Hardened, such arguments render as one parameter named `arguments`
  holding the value, so the history stays readable and the request is served.
* `reasoning_effort` values the template refuses. vLLM passes the request's
  `reasoning_effort` (none ... max) to templates that read the variable. Each value is tried;
  a refused one is mapped to the nearest value the template accepts.

The template is probed by rendering it exactly as vLLM does (transformers' sandboxed Jinja
environment). When a probe fails, a preamble that rebinds `messages` (and `reasoning_effort`)
goes in front of the unchanged template, behind a marker comment; a template that already
carries the marker is left as it is, so hardening twice changes nothing. The result must pass
every probe, or prepare refuses and the base template stays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.prepare.folder import Refused

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
MARKER = "{#- hyperqwen-prepare: hardened chat template"
# The values vLLM 0.26.0 accepts for reasoning_effort (ChatCompletionRequest), weakest first.
EFFORT_SCALE = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
MAPPING_ARGUMENTS = {"city": "Rome", "days": 3}
ARRAY_ARGUMENTS = ["Rome", 3]

ARGUMENTS_PREAMBLE = r"""
{#- Tool-call arguments that are not an object become {"arguments": value}. -#}
{%- set hyperqwen = namespace(messages=[]) -%}
{%- for message in messages -%}
    {%- if message.tool_calls is defined and message.tool_calls is iterable
        and message.tool_calls is not string and message.tool_calls is not mapping -%}
        {%- set rebuilt = namespace(calls=[]) -%}
        {%- for call in message.tool_calls -%}
            {%- set nested = call.function is defined and call.function is mapping -%}
            {%- set function = call.function if nested else call -%}
            {%- if function.arguments is not defined or function.arguments is none
                or function.arguments is mapping -%}
                {%- set rebuilt.calls = rebuilt.calls + [call] -%}
            {%- else -%}
                {%- set function = dict(function, arguments={'arguments': function.arguments}) -%}
                {%- set rebuilt.calls = rebuilt.calls
                    + [dict(call, function=function) if nested else function] -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set hyperqwen.messages = hyperqwen.messages
            + [dict(message, tool_calls=rebuilt.calls)] -%}
    {%- else -%}
        {%- set hyperqwen.messages = hyperqwen.messages + [message] -%}
    {%- endif -%}
{%- endfor -%}
{%- set messages = hyperqwen.messages -%}
""".strip()

EFFORT_PREAMBLE = r"""
{#- reasoning_effort values this template refuses become the nearest one it accepts. -#}
{%- if reasoning_effort is defined and reasoning_effort in MAPPING -%}
    {%- set reasoning_effort = MAPPING[reasoning_effort] -%}
{%- endif -%}
""".strip()


@dataclass(frozen=True)
class Probe:
    mapping_error: str | None
    array_error: str | None
    reads_effort: bool
    effort_errors: dict[str, str]  # value -> error, for the values the template refuses


@dataclass(frozen=True)
class Hardening:
    text: str
    report: dict  # what was found and done, for the marker file


def _render(template: str, arguments, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]
    rendered, _ = render_jinja_template(
        conversations=[conversation],
        tools=PROBE_TOOLS,
        chat_template=template,
        add_generation_prompt=True,
        **kwargs,
    )
    return rendered[0]


def _error(template: str, arguments, **kwargs) -> str | None:
    try:
        _render(template, arguments, **kwargs)
    except Exception as error:  # a template fails with any exception type: that is the probe
        return f"{type(error).__name__}: {error}"
    return None


def reads_variable(template: str, name: str) -> bool:
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(template).environment
    return name in meta.find_undeclared_variables(environment.parse(template))


def probe(template: str) -> Probe:
    """Render the probe conversation as vLLM would: object and array arguments, each effort."""
    reads_effort = reads_variable(template, "reasoning_effort")
    effort_errors = {}
    if reads_effort:
        for value in EFFORT_SCALE:
            # vLLM turns thinking on for any effort but "none" (build_chat_params).
            error = _error(
                template, MAPPING_ARGUMENTS, reasoning_effort=value, enable_thinking=value != "none"
            )
            if error:
                effort_errors[value] = error
    return Probe(
        mapping_error=_error(template, MAPPING_ARGUMENTS),
        array_error=_error(template, ARRAY_ARGUMENTS),
        reads_effort=reads_effort,
        effort_errors=effort_errors,
    )


def nearest_accepted(value: str, accepted: list[str]) -> str:
    """The accepted effort closest on the scale; on a tie, the weaker one."""
    position = EFFORT_SCALE.index(value)
    return min(accepted, key=lambda other: (abs(EFFORT_SCALE.index(other) - position), other))


def _check(found: Probe, what: str) -> None:
    problems = []
    if found.mapping_error:
        problems.append(f"tool-call arguments as an object: {found.mapping_error}")
    if found.array_error:
        problems.append(f"tool-call arguments as an array: {found.array_error}")
    problems += [
        f"reasoning_effort={value!r}: {error}" for value, error in found.effort_errors.items()
    ]
    if problems:
        raise Refused(f"the {what} chat template does not render: " + "; ".join(problems))


def harden(template: str) -> Hardening:
    """The hardened text (see the module docstring) and a report of what was done."""
    if MARKER in template:
        return Hardening(template, {"changed": False, "reason": "already hardened (marker)"})
    found = probe(template)
    if found.mapping_error:
        _check(found, "base")
    accepted = [value for value in EFFORT_SCALE if value not in found.effort_errors]
    if found.effort_errors and not accepted:
        _check(found, "base")
    effort_map = {value: nearest_accepted(value, accepted) for value in found.effort_errors}
    report = {
        "array_arguments": "hardened" if found.array_error else "already rendered",
        "reasoning_effort": (
            effort_map if effort_map else ("all accepted" if found.reads_effort else "not read")
        ),
    }
    if not found.array_error and not effort_map:
        return Hardening(template, {"changed": False, **report})
    preambles = []
    if effort_map:
        preambles.append(EFFORT_PREAMBLE.replace("MAPPING", json.dumps(effort_map)))
    if found.array_error:
        preambles.append(ARGUMENTS_PREAMBLE)
    header = (
        f"{MARKER} (pristine copy in .hyperqwen/pristine/). Prepended: "
        + ", ".join(
            (["reasoning_effort mapping"] if effort_map else [])
            + (["non-object tool-call arguments"] if found.array_error else [])
        )
        + ". The base template follows unchanged. -#}"
    )
    # trim_blocks drops the one newline after the last preamble tag: the base starts intact.
    text = "\n".join([header, *preambles]) + "\n" + template
    _check(probe(text), "hardened")
    return Hardening(text, {"changed": True, **report})


@dataclass(frozen=True)
class TemplateFile:
    """Where the base keeps its chat template: chat_template.jinja, or the chat_template string
    of tokenizer_config.json."""

    name: str
    base_text: str
    template: str

    def with_template(self, template: str) -> str:
        """The file's text holding `template` (the base text itself when unchanged)."""
        if template == self.template:
            return self.base_text
        if self.name == TEMPLATE_FILE:
            return template
        config = json.loads(self.base_text)
        config["chat_template"] = template
        return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def find_template(base_file) -> TemplateFile | None:
    """The base's template; `base_file(name)` gives the base copy of a file in the folder."""
    jinja: Path = base_file(TEMPLATE_FILE)
    if jinja.is_file():
        text = jinja.read_text()
        return TemplateFile(TEMPLATE_FILE, text, text)
    config_path: Path = base_file(TOKENIZER_CONFIG)
    text = config_path.read_text()
    template = json.loads(text).get("chat_template")
    if isinstance(template, str):
        return TemplateFile(TOKENIZER_CONFIG, text, template)
    return None
