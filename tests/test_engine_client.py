"""The engines' one HTTP client (rollout/engines/client.py): a pooled connection the server closed as it was
reused. The server here is a STAND-IN (raw asyncio): its first connection reads a request and closes without
an answer, as uvicorn does with an idle keep-alive connection; later connections answer 200."""
import asyncio

import pytest

from rollout.engines.client import EngineClient
from rollout.errors import EngineUnreachable

pytestmark = pytest.mark.timeout(30)


class _Eng:
    name, api_key = "e0", None

    def __init__(self, port):
        self.url = f"http://127.0.0.1:{port}"


async def _closing_server(seen):
    conns = 0

    async def handle(reader, writer):
        nonlocal conns
        conns += 1
        first = conns == 1
        line = await reader.readline()
        seen.append(line.split()[1].decode())
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if not first:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("call, path, repeated", [
    (lambda c, e: c.flush_cache(e), "/flush_cache", True),
    (lambda c, e: c.server_info(e), "/server_info", True),   # a GET: aiohttp's own retry (a guard)
    (lambda c, e: c.generate(e, {"input_ids": [1]}), "/generate", False),
])
def test_a_closed_pooled_connection_is_retried_once_only_where_the_call_may_repeat(call, path, repeated):
    async def go():
        seen = []
        server, port = await _closing_server(seen)
        try:
            async with EngineClient() as client:
                try:
                    await call(client, _Eng(port))
                    return seen, None
                except EngineUnreachable as e:
                    return seen, str(e)
        finally:
            server.close()
    seen, err = asyncio.run(go())
    if repeated:
        assert err is None and seen == [path, path]
    else:   # a generation is not sent twice behind the dispatcher's back: it re-sends with its own accounting
        assert seen == [path] and "Server disconnected" in err, err
