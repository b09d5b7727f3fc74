"""Chat templates with a tool-call format (Hermes / Qwen2.5's `<tool_call>` JSON blocks, Qwen3.5's `<function=...>`
tags, GLM's `<arg_key>` pairs, Llama 3.1's bare JSON, Mistral's `[TOOL_CALLS]...[ARGS]`) and a tool, for the tests of tool calls through `Llama` and
both servers' APIs."""

# the shape of Qwen2.5's template, reduced: tools described in the system turn, calls as <tool_call> blocks, a
# tool's result as a user turn in <tool_response>
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\nCall one with "
    "<tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"type": "string", "enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


def _with_calls(calls: str, how: str) -> str:
    """HERMES with its calls written as `calls` (Jinja over `c`, the call) and described to the model as `how`."""
    hermes_calls = ("{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
                    "c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}")
    hermes_how = "Call one with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"
    assert hermes_calls in HERMES and hermes_how in HERMES
    return HERMES.replace(hermes_calls, "{%- for c in m.tool_calls %}" + calls + "{%- endfor %}").replace(hermes_how, how)


_VALUE = "{{ v if v is string else v | tojson }}"
# Qwen3.5 / Qwen3-Coder's format, reduced
FUNCTION_TAGS = _with_calls("<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments | items %}"
                            "<parameter={{ k }}>\n" + _VALUE + "\n</parameter>\n{% endfor %}</function>\n</tool_call>",
                            "Call one with <tool_call> and <function=name> <parameter=key> tags")
# GLM 4.6's format, reduced
ARG_KEYS = _with_calls("<tool_call>{{ c.function.name }}\n{% for k, v in c.function.arguments | items %}<arg_key>{{ k }}"
                       "</arg_key>\n<arg_value>" + _VALUE + "</arg_value>\n{% endfor %}</tool_call>",
                       "Call one with <tool_call>name and <arg_key> <arg_value> pairs")
# Llama 3.1's format, reduced: the whole answer is the call
BARE_JSON = _with_calls("{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}",
                        'Call one by answering {"name": function name, "parameters": its arguments} only')
# Mistral Small 3.2's format, reduced
MISTRAL_ARGS = _with_calls("[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}",
                           "Call one with [TOOL_CALLS]name[ARGS]arguments")
TEMPLATES = {"json": HERMES, "function-tags": FUNCTION_TAGS, "arg-keys": ARG_KEYS, "bare-json": BARE_JSON,
             "mistral-args": MISTRAL_ARGS}
