"""The ChatML chat template written next to synthetic checkpoints.

It speaks the protocol vLLM's `qwen3` reasoning parser and `qwen3_coder` tool parser read:
assistant turns open with `<think>` (closed empty when `enable_thinking=False`), tool calls are
Qwen3-Coder XML (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
</function>\\n</tool_call>`), tool results go back as `<tool_response>` blocks inside a user turn,
and reasoning from turns before the latest user message is dropped, as Qwen3 templates do.
"""

CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- raise_exception('message content must be a string or a list of parts') -}}
    {%- endif -%}
{%- endmacro -%}

{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- set system_text = render_content(messages[0].content) if has_system else '' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_text -%}
        {{- system_text + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\n' -}}
    {{- 'If you choose to call a function ONLY reply in the following format ' -}}
    {{- 'with NO suffix:\n\n' -}}
    {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n' -}}
    {{- 'value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the ' -}}
    {{- 'second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n' -}}
    {{- '</tool_call>\n\n<IMPORTANT>\nReminder:\n' -}}
    {{- '- Function calls MUST follow the specified format: an inner <function=...></function> ' -}}
    {{- 'block must be nested within <tool_call></tool_call> XML tags\n' -}}
    {{- '- Required parameters MUST be specified\n' -}}
    {{- '- You may provide optional reasoning for your function call in natural language ' -}}
    {{- 'BEFORE the function call, but NOT after\n' -}}
    {{- '- If there is no function call available, answer the question like normal with your ' -}}
    {{- 'current knowledge and do not tell the user about function calls\n' -}}
    {{- '</IMPORTANT><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}

{%- set ns = namespace(last_user_index=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user_index = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}

{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('a system message is only allowed first') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string
            else (message.reasoning if message.reasoning is string else '') -%}
        {%- if not reasoning and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set content = content.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user_index and reasoning.strip('\n') -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {%- if not loop.first -%}
                {{- '\n' -}}
            {%- elif content -%}
                {{- '\n\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n<function=' + call.name + '>\n' -}}
            {%- if call.arguments is not mapping -%}
                {{- raise_exception('tool call arguments must be an object, not a JSON string') -}}
            {%- endif -%}
            {%- for name, value in call.arguments.items() -%}
                {{- '<parameter=' + name + '>\n' -}}
                {{- value if value is string else value | tojson -}}
                {{- '\n</parameter>\n' -}}
            {%- endfor -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()
