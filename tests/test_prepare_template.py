"""Chat-template hardening: tool-call arguments given as an array render, reasoning_effort values a
template refuses are mapped, hardening twice changes nothing, and vLLM's own request path
(its argument parsing and template-kwargs filter, transformers' renderer) serves the result."""

from __future__ import annotations

import ast
import json

import pytest
from test_prepare_common import copy_base, run_prepare, tiny_base_dir

from hyperqwen.checkpoint.chat_template import CHAT_TEMPLATE
from hyperqwen.prepare import template

# The tool-call and reasoning_effort handling of a Qwen3.5-style template: arguments walked with
# `|items` (as the Qwen3.5/3.6 templates do) and only three efforts accepted.
QWEN_STYLE = r"""
{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'medium', 'high'] %}
    {{- raise_exception('reasoning_effort must be low, medium or high') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {{- args_value | tojson if args_value is not string else args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if reasoning_effort is defined %}{{- 'effort=' + reasoning_effort }}{%- endif %}
{%- endif %}
""".strip()

# What QWEN_STYLE's refused efforts become: the nearest accepted, the weaker on a tie.
MAPPED_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}


def test_the_effort_scale_is_the_one_vllm_accepts(pristine_vllm_dir):
    source = (pristine_vllm_dir / "entrypoints/openai/chat_completion/protocol.py").read_text()
    tree = ast.parse(source)
    field = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "reasoning_effort"
    )
    literal = field.annotation.left  # Literal[...] | None
    values = [element.value for element in literal.slice.elts]
    assert tuple(values) == template.EFFORT_SCALE


@pytest.mark.parametrize(("source", "name"), [(CHAT_TEMPLATE, "synthetic"), (QWEN_STYLE, "qwen")])
def test_array_arguments_fail_before_and_render_after(source, name):
    assert template.probe(source).array_error
    hardened = template.harden(source)
    assert hardened.report["changed"] and hardened.report["array_arguments"] == "hardened"
    assert hardened.text.startswith(template.MARKER) and hardened.text.endswith(source)
    rendered = template._render(hardened.text, ["Rome", 3])
    assert '<parameter=arguments>\n["Rome", 3]\n</parameter>' in rendered
    # object arguments render exactly as the base template renders them
    assert template._render(hardened.text, {"city": "Rome", "days": 3}) == template._render(
        source, {"city": "Rome", "days": 3}
    )
    assert template.harden(hardened.text).text == hardened.text  # the marker: idempotent


def test_refused_efforts_map_to_the_nearest_accepted_one():
    found = template.probe(QWEN_STYLE)
    assert found.reads_effort
    assert set(found.effort_errors) == {"none", "minimal", "xhigh", "max"}
    hardened = template.harden(QWEN_STYLE)
    assert hardened.report["reasoning_effort"] == MAPPED_EFFORTS
    assert template.probe(hardened.text).effort_errors == {}
    for asked, used in (("max", "high"), ("minimal", "low"), ("medium", "medium")):
        rendered = template._render(hardened.text, {"city": "Rome"}, reasoning_effort=asked)
        assert rendered.endswith(f"effort={used}")
    # vLLM passes reasoning_effort only to templates that read it: still read after hardening
    assert template.reads_variable(hardened.text, "reasoning_effort")


def test_a_template_that_renders_everything_is_left_as_it_is():
    tolerant = "{%- for message in messages %}{{ message.role }}{% endfor %}"
    hardened = template.harden(tolerant)
    assert hardened.text == tolerant and hardened.report["changed"] is False


def test_a_template_that_cannot_render_object_arguments_is_refused():
    broken = "{%- for m in messages %}{% for c in m.tool_calls or [] %}{{ c.nope.x }}{% endfor %}"
    broken += "{% endfor %}"
    with pytest.raises(template.Refused, match="tool-call arguments as an object"):
        template.harden(broken)


def test_vllm_serves_array_arguments_and_every_effort_through_the_prepared_template(
    tmp_path_factory, vllm_cpu_platform
):
    from transformers import AutoTokenizer
    from vllm.entrypoints.chat_utils import _postprocess_messages
    from vllm.renderers.hf import resolve_chat_template_kwargs

    base = tiny_base_dir(tmp_path_factory)
    model = copy_base(base, tmp_path_factory.mktemp("template") / "model")
    (model / "chat_template.jinja").write_text(QWEN_STYLE)
    code, _, err = run_prepare(
        str(model),
        "--quiet",
        "--skip",
        "lm_head",
        "--skip",
        "embed",
        "--skip",
        "mtp",
        "--skip",
        "draft_vocab",
    )
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(["Rome", 3])},
                }
            ],
        },
        {"role": "user", "content": "Thanks."},
    ]
    _postprocess_messages(messages)  # vLLM turns the JSON string into a list here
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == ["Rome", 3]
    for effort in template.EFFORT_SCALE:
        kwargs = resolve_chat_template_kwargs(
            tokenizer,
            tokenizer.chat_template,
            {"reasoning_effort": effort, "enable_thinking": effort != "none"},
        )
        assert kwargs["reasoning_effort"] == effort
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert '<parameter=arguments>\n["Rome", 3]\n</parameter>' in text
        assert text.endswith("effort=" + MAPPED_EFFORTS.get(effort, effort))


def test_a_template_kept_in_tokenizer_config_is_found_and_rewritten_there(tmp_path):
    config = {"model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    text = json.dumps(config, indent=2)
    (tmp_path / template.TOKENIZER_CONFIG).write_text(text)
    found = template.find_template(lambda name: tmp_path / name)
    assert found.name == template.TOKENIZER_CONFIG and found.template == CHAT_TEMPLATE
    assert found.with_template(CHAT_TEMPLATE) == text  # unchanged: the very same bytes
    rewritten = json.loads(found.with_template("{{ 'x' }}"))
    assert rewritten == {**config, "chat_template": "{{ 'x' }}"}
    (tmp_path / template.TOKENIZER_CONFIG).write_text(json.dumps({"model_max_length": 1}))
    assert template.find_template(lambda name: tmp_path / name) is None
