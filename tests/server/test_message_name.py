"""``messages[].name`` reaches the chat template: a template that renders it shows it, one that
does not (the demo's own) leaves the prompt unchanged."""

from __future__ import annotations

import httpx
import pytest
from scene_helpers import TEST_DEVICE, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.loading.loader import load_model

# The demo's template, but a user turn with a name opens with "user <name>:" (OpenAI's "name":
# the participant's name, which some templates render).
NAMED = "{%- if message.get('name') -%}{{ 'user ' + message['name'] + ':' }}{%- else -%}{{ 'user:' }}{%- endif -%}"


@pytest.fixture(scope="module")
def servers(demo_model):
    """(the demo's own template, the same model with a template that renders name)."""
    named = load_model(None, device=TEST_DEVICE, dtype="float32")
    template = named.processor.chat_template  # the LLaVA processor's own, which it renders with
    assert "{{ 'user:' }}" in template
    named.processor.chat_template = template.replace("{{ 'user:' }}", NAMED)
    running = []
    for loaded in (demo_model, named):
        settings = ServerSettings(host="127.0.0.1", port=free_port(), device=TEST_DEVICE, dtype="float32",
                                  canary=False)
        running.append(start_server(settings, loaded))
    yield [live for live, _, _ in running]
    for _, server, thread in running:
        stop_server(server, thread)


def tokens(server, **message) -> list[str]:
    body = {"messages": [{"role": "user", "content": "how many shapes are there ?", **message}],
            "return_token_strs": True}
    reply = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["token_strs"]


def test_a_template_that_renders_name_gets_it(servers):
    plain, named = servers
    assert tokens(named, name="blue")[:4] == ["<s>", "user", "blue", ":"]
    assert tokens(named)[:3] == ["<s>", "user", ":"]
    # The demo's own template has no place for a name: the same prompt with or without it.
    assert tokens(plain, name="blue") == tokens(plain) == tokens(named)
    chat = httpx.post(named.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "how many shapes are there ?", "name": "blue"}], "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens(named, name="blue"))
