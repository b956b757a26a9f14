"""The default system prompt read off a chat template (`ChatRoles.default_system_prompt`):
what the template writes when a conversation starts without a system message. The
reference is the template itself: with that prompt as an explicit system message, the
conversation renders to the same text as without one."""

from __future__ import annotations

import jinja2
import pytest

from lmprog.chat_template import ChatRoles
from lmprog_runtime.models.default_model import CHAT_TEMPLATE

CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)
SMOL_LIKE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM,\\n"
    "trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)
NO_SYSTEM_ALLOWED = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ raise_exception('System role not supported') }}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
)
# Llama 3.1's shape: a system block always, a fixed header in it, its own content empty
# unless given.
HEADER_ALWAYS = (
    "{%- if messages[0]['role'] == 'system' -%}{%- set sys = messages[0]['content'] -%}"
    "{%- set messages = messages[1:] -%}{%- else -%}{%- set sys = '' -%}{%- endif -%}"
    "{{- '<|header|>system<|end|>\\n\\nCutting Knowledge Date: December 2023\\n\\n' + sys -}}"
    "{{- '<|eot|>' -}}"
    "{%- for m in messages -%}"
    "{{- '<|header|>' + m['role'] + '<|end|>\\n\\n' + m['content'] + '<|eot|>' -}}"
    "{%- endfor -%}"
)


def _renderer(template: str):
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    compiled = jinja2.Environment().from_string(template)
    return lambda messages: compiled.render(messages=messages, raise_exception=raise_exception)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (CHAT_TEMPLATE, "You are a helpful assistant."),
        (SMOL_LIKE, "You are a helpful AI assistant named SmolLM,\ntrained by Hugging Face"),
        (CHATML, None),
        (NO_SYSTEM_ALLOWED, None),
        (HEADER_ALWAYS, None),
    ],
)
def test_the_default_system_prompt_is_what_the_template_writes(template, expected):
    render = _renderer(template)
    found = ChatRoles(render).default_system_prompt()
    assert found == expected
    user = [{"role": "user", "content": "Hi there"}]
    if found is not None:  # as an explicit system message, the same conversation
        assert render([{"role": "system", "content": found}, *user]) == render(user)
