"""What several engine tests share: run prompts through a started engine and collect their tokens."""

from __future__ import annotations

import asyncio

from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent


def tokens_of(engine, prompts, params) -> list[list[int]]:
    """Each prompt's sampled token ids, the prompts run concurrently; an error event is raised."""

    async def one(prompt):
        tokens = []
        async for event in engine.generate(prompt, params):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                tokens.append(event.token_id)
            elif isinstance(event, ErrorEvent):
                raise event.error
            elif isinstance(event, FinishEvent):
                return tokens
        raise AssertionError("no finish event")

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            engine.stop()

    return asyncio.run(main())
