"""The built-in chat templates, for checkpoints that carry none of their own (the packaged
Qwen vocabulary, random test checkpoints). Each renders an assistant turn's `tool_calls`, the
`tool` turns that answer them and the request's `tools` in the markup of its family's own
template, which the server's tool-call parsers (`sparrow/server/tool_parsers.py`) read back:

- ChatML with Qwen3.5 / 3.6's conventions: the generation prompt opens a <think> block (an
  empty one when `enable_thinking` is false) and earlier assistant reasoning is not shown;
  a call is `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>` (strings raw, other values as JSON), tool results are
  `<tool_response>` blocks in one user turn, the tools a system turn's JSON list.
- MiniMax: `]~!b[` once, then per message `]~b]{role}\\n{content}[e~[\\n`, the assistant's role
  spelled "ai"; M3's calls are one `]<]minimax[>[`-tagged block of `<invoke>`s whose argument
  names are the tags (objects nest, arrays are `<item>`s, booleans JSON), tool results
  `<response>`s in one `tool` turn.

Arguments are objects here (HF's convention); the server decodes OpenAI's JSON text first.
"""

CHATML_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}
{%- for part in content or [] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- elif part['type'] in ('image', 'image_url') -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part['type'] in ('video', 'video_url') -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou may call these functions:\\n\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call one, reply with the call and nothing after it:\\n\\n<tool_call>\\n'
    '<function=NAME>\\n<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' -}}
{%- if messages[0]['role'] == 'system' -%}{{- '\\n\\n' + render(messages[0]['content']) -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = render(message['content']) -%}
{%- if message['role'] == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- elif not (tools and loop.first and message['role'] == 'system') -%}
{%- if message['role'] == 'assistant' and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\\n' + content -}}
{%- for call in message['tool_calls'] or [] -%}
{%- set call = call['function'] if call['function'] is defined else call -%}
{%- if loop.first -%}{{- '\\n\\n' if content | trim else '' -}}{%- else -%}{{- '\\n' -}}
{%- endif -%}
{{- '<tool_call>\\n<function=' + call['name'] + '>\\n' -}}
{%- for name, value in (call['arguments'] or {}) | items -%}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson)
    + '\\n</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and not enable_thinking -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""

MINIMAX_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}
{%- for part in content or [] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- elif part['type'] in ('image', 'image_url') -%}{{- ']<]image[>[' -}}
{%- elif part['type'] in ('video', 'video_url') -%}{{- ']<]video[>[' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro to_xml(value) -%}
{%- if value is mapping -%}
{%- for key, item in value | items if item is not none -%}
{{- ']<]minimax[>[<' + key + '>' + to_xml(item) + ']<]minimax[>[</' + key + '>' -}}
{%- endfor -%}
{%- elif value is iterable and value is not string -%}
{%- for item in value -%}
{{- ']<]minimax[>[<item>' + to_xml(item) + ']<]minimax[>[</item>' -}}
{%- endfor -%}
{%- elif value is boolean -%}{{- value | tojson -}}
{%- elif value is not none -%}{{- value | string -}}
{%- endif -%}
{%- endmacro -%}
{%- macro tool_section(tools) -%}
{{- '# Tools\\nYou may call these functions:\\n\\n<tools>\\n' -}}
{%- for tool in tools -%}
{{- '<tool>' + (tool['function'] if tool['function'] is defined else tool) | tojson
    + '</tool>\\n' -}}
{%- endfor -%}
{{- '</tools>\\n\\nTo call them, write every call in one ]<]minimax[>[<tool_call>'
    ']<]minimax[>[</tool_call> block, nested values as XML elements:\\n\\n'
    ']<]minimax[>[<tool_call>\\n]<]minimax[>[<invoke name="NAME">]<]minimax[>[<ARGUMENT>VALUE'
    ']<]minimax[>[</ARGUMENT>]<]minimax[>[</invoke>\\n]<]minimax[>[</tool_call>' -}}
{%- endmacro -%}
{{- ']~!b[' -}}
{%- if tools and messages[0]['role'] != 'system' -%}
{{- ']~b]system\\n' + tool_section(tools) + '[e~[\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = render(message['content']) -%}
{%- if message['role'] == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- ']~b]tool' -}}{%- endif -%}
{{- '\\n<response>' + content + '</response>' -}}
{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '[e~[\\n' -}}{%- endif -%}
{%- else -%}
{%- if tools and loop.first and message['role'] == 'system' -%}
{%- set content = content + '\\n\\n' + tool_section(tools) -%}
{%- endif -%}
{{- ']~b]' + ('ai' if message['role'] == 'assistant' else message['role']) + '\\n'
    + content -}}
{%- if message['tool_calls'] -%}
{{- ']<]minimax[>[<tool_call>\\n' -}}
{%- for call in message['tool_calls'] -%}
{%- set call = call['function'] if call['function'] is defined else call -%}
{{- ']<]minimax[>[<invoke name="' + call['name'] + '">' + to_xml(call['arguments'] or {})
    + ']<]minimax[>[</invoke>\\n' -}}
{%- endfor -%}
{{- ']<]minimax[>[</tool_call>' -}}
{%- endif -%}
{{- '[e~[\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}
"""

# The built-in templates by name (`models.interface.TokenizerLayout.chat_template`).
TEMPLATES = {"chatml": CHATML_TEMPLATE, "minimax": MINIMAX_TEMPLATE}
