"""An error the engine raises reaches the client with its own code (and is counted), not as engine_error."""


import httpx
from scene_helpers import data_url, fresh_scene, one_image_row_short

from fovea.demo import scenes


def test_the_engines_placeholder_guard_is_a_modality_mismatch(make_server, assert_error):
    live = make_server()
    restore = one_image_row_short(live)  # the engine's placeholder guard fails the request once it runs
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
        restore()
    metrics = httpx.get(live.base_url + "/metrics").text
    line = next(l for l in metrics.splitlines()
                if l.startswith('fovea_modality_mismatch_errors_total{reason="image_placeholder_mismatch"}'))
    assert float(line.split()[1]) == 2  # the JSON answer and the stream
