"""An error the engine raises reaches the client with its own code (and is counted), not as engine_error."""

import dataclasses

import httpx
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes


def test_the_engines_placeholder_guard_is_a_modality_mismatch(make_server, assert_error):
    live = make_server()
    pre = live.app.state.fovea.preprocessor
    prompts = pre.prompts

    async def one_row_short(*args, **kwargs):
        prompt, twin = await prompts(*args, **kwargs)
        # A hand-off that lost a row: the engine's own guard must catch it before the model runs.
        shorter = dataclasses.replace(prompt.images[0], num_tokens=prompt.images[0].num_tokens - 1)
        return dataclasses.replace(prompt, images=[shorter, *prompt.images[1:]]), twin

    pre.prompts = one_row_short
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(scenes.render(fresh_scene(8100)))}},
        {"type": "text", "text": "Describe the image."}]}]}
    try:
        error = assert_error(httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=60),
                             500, "image_placeholder_mismatch")
        assert "image-token positions" in error["message"]
        with httpx.stream("POST", live.base_url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as reply:
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"image_placeholder_mismatch"' in events[-2]
    finally:
        pre.prompts = prompts
    metrics = httpx.get(live.base_url + "/metrics").text
    line = next(l for l in metrics.splitlines()
                if l.startswith('fovea_modality_mismatch_errors_total{reason="image_placeholder_mismatch"}'))
    assert float(line.split()[1]) == 2  # the JSON answer and the stream
