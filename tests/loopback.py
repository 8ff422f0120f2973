"""A loopback aiohttp app for stand-in engines in tests: start it, get its runner and port."""
from aiohttp import web


async def start_app(app: web.Application, host: str = "127.0.0.1", shutdown_timeout: float = 0.5):
    """(runner, port) of `app` served on a free port of `host`; `await runner.cleanup()` stops it."""
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
