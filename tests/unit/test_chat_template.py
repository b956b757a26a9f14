"""Role texts read off a chat template (`ChatRoles`): written message by message, a
conversation is the text the template renders for all of it at once; and the default
system prompt (`ChatRoles.default_system_prompt`): what the template writes when a
conversation starts without a system message. The reference is the template itself: with
that prompt as an explicit system message, the conversation renders to the same text as
without one."""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

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
    return lambda messages, add_generation_prompt=False: compiled.render(
        messages=messages,
        raise_exception=raise_exception,
        bos_token="<s>",
        eos_token="</s>",
        add_generation_prompt=add_generation_prompt,
    )


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


ALTERNATE = (  # Mistral-Instruct v0.2's shape: roles must alternate from a user message
    "{{- bos_token -}}{%- for m in messages -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}"
    "{%- endif -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- m['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('Only user and assistant roles are supported!') -}}"
    "{%- endif -%}{%- endfor -%}"
)
SYSTEM_IN_FIRST_TURN = (  # Llama 2 chat's shape: the system message inside the first [INST]
    "{%- if messages[0]['role'] == 'system' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- set system_message = messages[0]['content'] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- set system_message = false -%}"
    "{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}"
    "{%- endif -%}"
    "{%- if loop.index0 == 0 and system_message != false -%}"
    "{%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + m['content'] -%}"
    "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
    "{%- if m['role'] == 'user' -%}{{- bos_token + '[INST] ' + content + ' [/INST]' -}}"
    "{%- else -%}{{- ' ' + content + ' ' + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
CONVERSATIONS = [
    ["user", "assistant", "user", "assistant", "user"],
    ["system", "user", "assistant", "user", "assistant"],
    ["system", "user"],
    ["user"],
    ["user", "system", "user"],  # (a later system message: Llama 2 writes it as a reply)
]


@pytest.mark.parametrize(
    "template", [CHATML, SMOL_LIKE, HEADER_ALWAYS, ALTERNATE, SYSTEM_IN_FIRST_TURN]
)
@pytest.mark.parametrize("roles", CONVERSATIONS)
def test_a_conversation_written_role_by_role_is_the_template_s_render(template, roles):
    """Mistral's and Llama 2's templates once refused a second user turn (the last message
    alone, an assistant's, rendered as the first), and Llama 2's a system message (whose
    text it writes only with the user message that follows)."""
    _check_written_as_rendered(template, roles)


@pytest.mark.parametrize(
    ("template", "first"), [(ALTERNATE, []), (SYSTEM_IN_FIRST_TURN, ["system"])]
)
def test_a_long_conversation_keeps_few_whole_reads_and_writes_the_template_s_render(
    template, first, monkeypatch
):
    """A template that checks the whole conversation is read at each length; the reads kept
    are bounded (a 2,000-turn chat held 51 MiB of keys), and one read again is the same."""
    import lmprog.chat_template as chat_template

    monkeypatch.setattr(chat_template, "MAX_WHOLE_KEYS", 4)
    render = _renderer(template)
    roles = first + ["user", "assistant"] * 12
    messages = [{"role": r, "content": f"{r} says {i}"} for i, r in enumerate(roles)]
    chat = ChatRoles(render)
    for _ in range(2):  # (the second time, the early reads were dropped: read again)
        assert _written(chat, messages) == render(messages)
        assert 0 < len(chat._whole_cache) <= 4


NUMBERED = ALTERNATE.replace("'[INST] '", "'[INST ' ~ loop.index ~ '] '")


@pytest.mark.parametrize(
    ("template", "first", "windows_hold"),
    [
        (ALTERNATE, [], True),
        (SYSTEM_IN_FIRST_TURN, ["system"], True),
        (NUMBERED, [], False),  # (each user turn writes its number: only the whole reads)
    ],
)
def test_a_long_conversation_is_read_off_a_window_where_that_reads_as_the_whole(
    template, first, windows_hold
):
    """Rendered whole at each turn, such a template cost a turn time in proportion to the
    conversation's length: its last messages now stand in for it once they read as it
    does, and renders stay short however long the conversation."""
    render = _renderer(template)
    longest = []

    def measured(messages):
        longest.append(len(messages))
        return render(messages)

    roles = first + ["user", "assistant"] * 30
    messages = [{"role": r, "content": f"{r} says {i}"} for i, r in enumerate(roles)]
    chat = ChatRoles(measured)
    assert _written(chat, messages) == render(messages)
    assert chat._windows_hold == windows_hold
    late = longest[len(longest) // 2 :]
    assert max(late) <= 8 if windows_hold else max(late) > 30


@given(
    st.sampled_from(
        [ALTERNATE, SYSTEM_IN_FIRST_TURN, NUMBERED, CHATML, SMOL_LIKE, HEADER_ALWAYS, CHAT_TEMPLATE]
    ),
    st.lists(st.sampled_from(["user", "assistant", "system"]), min_size=1, max_size=14),
    st.integers(0, 13),
)
def test_any_conversation_is_written_as_the_template_renders_it_or_refused(
    template, roles, alternating
):
    """Roles alternating for a while, then drawn at random: written role by role (windows
    standing in for the whole where they read as it), each is the template's render, or
    refused where the template refuses it. (A system message after the first, read alone
    as a first one, was written into the next user turn by Llama 2's shape.)"""
    cycle = ["user", "assistant"] * 7
    roles = (
        roles[:1] + cycle[:alternating] + roles[1:]
        if roles[0] == "system"
        else cycle[:alternating] + roles
    )
    assume(roles != ["system"])  # (Llama 2 writes it with the user message after it)
    _check_written_as_rendered(template, roles)


def _check_written_as_rendered(template: str, roles: list[str]) -> None:
    """Written role by role, the conversation is the template's render, or is refused where
    the template refuses it."""
    render = _renderer(template)
    messages = [{"role": r, "content": f"{r} says {i}"} for i, r in enumerate(roles)]
    try:
        expected = render(messages)
    except jinja2.TemplateError:
        with pytest.raises(ValueError, match="refuses"):
            _written(ChatRoles(render), messages)
        return
    assert _written(ChatRoles(render), messages) == expected


def _written(chat: ChatRoles, messages: list[dict[str, str]]) -> str:
    """The text of `messages` as a program writes it: each role's begin, content, end."""
    roles = [m["role"] for m in messages]
    default = chat.default_system_prompt()
    if default is not None and roles[0] != "system":  # (what ops.py records)
        roles.insert(0, "system")
        messages = [{"role": "system", "content": default}, *messages]
        written, first = "", 1
    else:
        written, first = "", 0
    for i in range(first, len(messages)):
        text = chat.role_text(roles[i], roles[first:i] if i == first else roles[:i])
        written += text.begin + messages[i]["content"] + text.end
    return written


LAST_THINKS = (  # Qwen3's shape: the last assistant message gets an (empty) think block
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_an_assistant_turn_begins_with_the_templates_generation_prompt():
    """Read as the last message, Qwen3's assistant turn began with an empty think block,
    which turns the model's thinking off (and was written into every earlier turn too);
    transformers prompts generation with `add_generation_prompt=True`, without it."""
    render = _renderer(LAST_THINKS)
    chat = ChatRoles(render, lambda m: render(m, add_generation_prompt=True))
    user = [{"role": "user", "content": "Hi"}]
    prompt = _written(chat, user) + chat.role_text("assistant", ["user"]).begin
    assert prompt == render(user, add_generation_prompt=True)
    turns = [*user, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert _written(chat, turns) == render(turns)


def test_a_template_that_writes_no_generation_prompt_keeps_the_turns_own_begin():
    """Older templates ignore `add_generation_prompt` (ChatML here): the prompt adds
    nothing, so the assistant turn begins as the template writes the message."""
    render = _renderer(CHATML)
    chat = ChatRoles(render, lambda m: render(m, add_generation_prompt=True))
    text = chat.role_text("assistant", ["user"])
    assert (text.begin, text.end) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert _written(chat, turns) == render(turns)


# Phi-3's shape: the end-of-text token after a conversation's last message, never before a
# generation prompt.
CLOSED_BY_EOS = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- else -%}{{- eos_token -}}"
    "{%- endif -%}"
)


@pytest.mark.parametrize("roles", CONVERSATIONS)
def test_a_template_closing_a_conversation_with_end_of_text_writes_roles_without_it(roles):
    """Every such template was refused ("rewrites earlier messages"): the end of text read
    as the end of each message. Its roles are the render without the trailer, and an
    assistant turn opens as the generation prompt does."""
    render = _renderer(CLOSED_BY_EOS)
    chat = ChatRoles(render, lambda m: render(m, add_generation_prompt=True), ["<s>", "</s>"])
    assert chat.trailer() == "</s>"
    messages = [{"role": r, "content": f"{r} says {i}"} for i, r in enumerate(roles)]
    expected = render(messages)
    assert expected.endswith("<|end|>\n</s>")
    assert _written(chat, messages) == expected.removesuffix("</s>")
    if roles[-1] == "user":
        prompt = _written(chat, messages) + chat.role_text("assistant", roles).begin
        assert prompt == render(messages, add_generation_prompt=True)


@pytest.mark.parametrize("template", [CHATML, SMOL_LIKE, ALTERNATE, SYSTEM_IN_FIRST_TURN])
def test_templates_without_a_trailer_have_none(template):
    render = _renderer(template)
    chat = ChatRoles(render, lambda m: render(m, add_generation_prompt=True), ["<s>", "</s>"])
    assert chat.trailer() == ""


def test_an_engine_reads_the_trailer_off_its_tokenizer_s_special_tokens(tiny_path):
    """The engine's role texts take the tokenizer's own special tokens as trailers."""
    from transformers import AutoTokenizer

    from lmprog.backend import _ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.chat_template = CLOSED_BY_EOS
    chat = _ChatTemplate(tokenizer)
    assert chat.roles.trailer() == tokenizer.eos_token
    user = [{"role": "user", "content": "Hi"}]
    begin, end = chat.roles.role_text("user", [])
    assert begin + "Hi" + end == chat(user).removesuffix(tokenizer.eos_token)


@given(
    roles=st.lists(st.sampled_from(["system", "user", "assistant"]), max_size=6),
    index=st.integers(-8, 8),
    bounds=st.tuples(
        st.none() | st.integers(-8, 8),
        st.none() | st.integers(-8, 8),
        st.none() | st.integers(-3, 3).filter(bool),
    ),
)
def test_a_programs_roles_view_reads_as_the_list_of_its_messages_roles(roles, index, bounds):
    """What `ops.py` hands the template (a view: the list built at every role made a chat
    of n turns cost n^2) reads as the list of roles of the messages it was made over, and
    stays so as the program appends more."""
    from lmprog.ops import _Roles

    messages = [{"role": r, "content": "x"} for r in roles]
    view = _Roles(messages)
    messages.append({"role": "user", "content": "later"})  # (a role's end appends its own)
    assert len(view) == len(roles) and list(view) == roles and bool(view) == bool(roles)
    assert view[slice(*bounds)] == roles[slice(*bounds)] and view[-1:] == roles[-1:]
    if -len(roles) <= index < len(roles):
        assert view[index] == roles[index]
    else:
        with pytest.raises(IndexError):
            view[index]  # noqa: B018
