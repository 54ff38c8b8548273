"""A Qwen3-like chat template for tests: tools in the system turn, tool calls as
<tool_call> JSON, tool answers as <tool_response> inside a user turn, a think block on the
assistant turns after the last user query (empty unless reasoning_content), and
`enable_thinking=False` adding an empty think block to the generation prompt. Written here
from the behaviour it imitates; the tiny tokenizer gets the tags as added tokens."""

from dflash_ipc.builtin.tiny import build_tiny_tokenizer

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or m.reasoning_content) %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for call in m.tool_calls or [] %}{{- '\\n<tool_call>\\n' + "
    "({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen_like_tokenizer():
    """The tiny tokenizer with the tags above as added tokens and the Qwen3-like template."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(list(TAGS))
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok
