import asyncio

import uvloop


async def test_runs_on_uvloop_in_debug_mode() -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, uvloop.Loop)
    assert loop.get_debug()
