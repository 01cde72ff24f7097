"""Preprocessing in worker processes answers exactly as in threads, refuses bad images with the
same codes and paths, and the large-image lane bounds large decodes without holding up small ones."""

import asyncio

import httpx
import pytest
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.media import MediaConfig
from fovea.serve.preprocess import DecodeBudget, PreprocessingFailed, Preprocessor


def ask(base: str, url: str, **extra) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=120, json={"temperature": 0, **extra, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Describe the image."}]}]})


@pytest.fixture(scope="module")
def pooled(make_server):
    return make_server(preprocess_workers=2)


def test_worker_processes_answer_as_the_threads_do(pooled, live_server):
    for seed in range(3):
        scene = fresh_scene(6000 + seed)
        url = data_url(scenes.render(scene), "JPEG" if seed % 2 else "PNG")
        here, there = ask(pooled.base_url, url), ask(live_server.base_url, url)
        assert here.status_code == there.status_code == 200
        assert here.json()["choices"][0]["message"]["content"] == there.json()["choices"][0]["message"]["content"] \
            == scenes.describe_answer(scene)
    assert pooled.app.state.fovea.preprocessor.pool is not None


def test_worker_processes_refuse_bad_images_with_code_and_path(pooled, assert_error):
    assert_error(ask(pooled.base_url, "data:image/png;base64,AAAA"), 400, "invalid_image", "messages[0].content[0]")
    huge = "data:image/png;base64," + data_url(scenes.render(fresh_scene(1)).resize((8000, 6000)))[22:]
    assert_error(ask(pooled.base_url, huge), 400, "image_too_large", "messages[0].content[0]")


def test_worker_processes_serve_grounding_twins(pooled):
    scene = fresh_scene(6100)
    reply = ask(pooled.base_url, data_url(scenes.render(scene)), fovea={"grounding": True}).json()
    assert reply["fovea"]["grounding"]["image_dependent"] is True


def test_workers_that_do_not_run_the_contracts_recipe_are_refused(demo_model):
    with pytest.raises(PreprocessingFailed, match="refusing to start"):
        Preprocessor(demo_model, MediaConfig(), 1, recipe_fingerprint="0123456789abcdef")


def test_the_processors_target_size_is_read_from_its_config(demo_model):
    assert demo_model.codec.target_short_side() == 128


def test_large_decodes_share_a_budget_and_never_hold_up_small_ones():
    async def main():
        budget = DecodeBudget(total_bytes=100, concurrency=2)
        order: list[str] = []
        release = asyncio.Event()

        async def large(name: str, nbytes: int):
            async with budget.hold(nbytes):
                order.append(f"{name} start")
                await release.wait()
            order.append(f"{name} end")

        first = asyncio.create_task(large("a", 70))
        await asyncio.sleep(0)
        second = asyncio.create_task(large("b", 70))  # 70 + 70 > 100: waits for a
        await asyncio.sleep(0)
        assert order == ["a start"] and budget.in_use == 70
        order.append("small done")  # a small request takes no share: it runs now
        release.set()
        await asyncio.gather(first, second)
        assert order == ["a start", "small done", "a end", "b start", "b end"]
        assert budget.in_use == 0 and budget.peak_running == 1

        wide = DecodeBudget(total_bytes=100, concurrency=1)  # and never more at once than allowed
        await asyncio.gather(*(asyncio.create_task(_hold(wide, 10)) for _ in range(5)))
        assert wide.peak_running == 1
        huge = DecodeBudget(total_bytes=100, concurrency=4)  # larger than the whole budget: runs alone
        await _hold(huge, 10_000)
        assert huge.in_use == 0

    asyncio.run(main())


async def _hold(budget: DecodeBudget, nbytes: int) -> None:
    async with budget.hold(nbytes):
        await asyncio.sleep(0)


def test_a_worker_that_dies_fails_its_request_loudly_and_is_replaced(demo_model):
    import os
    import signal

    from fovea.loading.contract import check_contract

    contract = check_contract(demo_model)
    pre = Preprocessor(demo_model, MediaConfig(), 1, contract.recipe_fingerprint)
    try:
        image = data_url(scenes.render(fresh_scene(6200)))
        import base64

        data = base64.b64decode(image.split(",", 1)[1])
        text = "USER: <image> Describe the image. ASSISTANT:"
        for pid in list(pre.pool._processes):  # the worker is killed, as the kernel's OOM killer would
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(PreprocessingFailed, match="died"):
            asyncio.run(pre.prompts(text, [(data, "images[0]")], template_rendered=False))
        prompt, _ = asyncio.run(pre.prompts(text, [(data, "images[0]")], template_rendered=False))
        assert prompt.num_images == 1 and prompt.image_token_counts == [64]
    finally:
        pre.close()
