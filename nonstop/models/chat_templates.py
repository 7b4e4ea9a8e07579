"""Built-in chat templates (Jinja sources) for the Llama 3, Qwen and Gemma formats.

They are written for nonstop, in the layout of each family's published template, so they can be
stored in a checkpoint's tokenizer_config.json and rendered unchanged by transformers'
`apply_chat_template`. Every template renders a message's content verbatim (no trimming) and renders
history without looking ahead, so that rendering one more turn only appends text; the one exception
is grouping: consecutive tool results share one turn in Qwen and Gemma, so a Conversation must append
the results of one assistant turn together.

- Llama 3 (3.1-style tool use): tool schemas in the system turn, an assistant tool call is a JSON
  object {"name": ..., "parameters": ...}, a tool result is an `ipython` turn.
- Qwen (ChatML, as Qwen2.5/Qwen3): tool schemas inside <tools></tools> in the system turn, tool calls
  as <tool_call>{json}</tool_call>, tool results as <tool_response> blocks inside one user turn.
- Gemma: <start_of_turn>user / model; the system message opens the first user turn; Gemma has no tool
  role, so schemas, calls (```tool_call```) and results (```tool_output```) are plain text.
"""

from __future__ import annotations

from typing import Literal

ChatFormat = Literal["llama3", "qwen", "gemma"]
CHAT_FORMATS: tuple[ChatFormat, ...] = ("llama3", "qwen", "gemma")

# Content is a string or a list of {"type": "text", "text": ...} blocks, as in transformers.
_RENDER_CONTENT = """{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for block in content %}
            {%- if block.type == 'text' %}
                {{- block.text }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is defined and content is not none %}
        {{- content | tojson }}
    {%- endif %}
{%- endmacro %}
"""

# Arguments are a JSON object, or already a JSON string as in the OpenAI API.
_RENDER_ARGUMENTS = """{%- macro render_arguments(arguments) %}
    {%- if arguments is string %}
        {{- arguments }}
    {%- else %}
        {{- arguments | tojson }}
    {%- endif %}
{%- endmacro %}
"""

LLAMA3_TEMPLATE = (
    _RENDER_CONTENT
    + _RENDER_ARGUMENTS
    + """{%- macro render_tools() %}
    {{- 'You have access to the following functions. To call a function, respond with a JSON object '
        'of the form {"name": function name, "parameters": dictionary of argument name and its value}.'
        '\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endmacro %}
{{- bos_token }}
{%- for message in messages %}
    {%- if loop.first and tools and message.role != 'system' %}
        {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + render_tools() + '<|eot_id|>' }}
    {%- endif %}
    {%- if message.role == 'system' %}
        {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + render_content(message.content) }}
        {%- if loop.first and tools %}
            {{- '\\n\\n' + render_tools() }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' + render_content(message.content) + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + render_content(message.content) }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' + render_arguments(tool_call.arguments) + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + render_content(message.content) + '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception('Llama 3 template: unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
)

QWEN_TEMPLATE = (
    _RENDER_CONTENT
    + _RENDER_ARGUMENTS
    + """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
        'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + render_content(message.content) }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + render_arguments(tool_call.arguments) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Qwen template: unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

GEMMA_TEMPLATE = (
    _RENDER_CONTENT
    + _RENDER_ARGUMENTS
    + """{%- macro render_tools() %}
    {{- 'You have access to the following functions. To call a function, reply with\\n'
        '```tool_call\\n{"name": function name, "arguments": dictionary of argument name and its value}'
        '\\n```\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=2) + '\\n\\n' }}
    {%- endfor %}
{%- endmacro %}
{{- bos_token }}
{%- set ns = namespace(user_open=false) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not ns.user_open %}
            {{- '<start_of_turn>user\\n' }}
            {%- set ns.user_open = true %}
        {%- endif %}
        {{- render_content(message.content) + '\\n\\n' }}
        {%- if loop.first and tools %}
            {{- render_tools() }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {%- if not ns.user_open %}
            {{- '<start_of_turn>user\\n' }}
            {%- if loop.first and tools %}
                {{- render_tools() }}
            {%- endif %}
        {%- endif %}
        {{- render_content(message.content) + '<end_of_turn>\\n' }}
        {%- set ns.user_open = false %}
    {%- elif message.role == 'assistant' %}
        {%- if ns.user_open %}
            {{- '<end_of_turn>\\n' }}
            {%- set ns.user_open = false %}
        {%- endif %}
        {{- '<start_of_turn>model\\n' + render_content(message.content) }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '```tool_call\\n{"name": "' + tool_call.name + '", "arguments": ' + render_arguments(tool_call.arguments) + '}\\n```' }}
        {%- endfor %}
        {{- '<end_of_turn>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {%- if not ns.user_open %}
                {{- '<start_of_turn>user\\n' }}
            {%- endif %}
        {%- else %}
            {{- '\\n' }}
        {%- endif %}
        {{- '```tool_output\\n' + render_content(message.content) + '\\n```' }}
        {%- set ns.user_open = true %}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<end_of_turn>\\n' }}
            {%- set ns.user_open = false %}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Gemma template: unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {%- if ns.user_open %}
        {{- '<end_of_turn>\\n' }}
    {%- endif %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""
)

BUILTIN_TEMPLATES: dict[ChatFormat, str] = {
    "llama3": LLAMA3_TEMPLATE,
    "qwen": QWEN_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
}
