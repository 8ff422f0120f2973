"""The ASGI app an SGLang HTTP worker imports when the engine runs more than one tokenizer worker (the
`tokenizer-workers` fix points the workers here): SGLang's own `load_plugins()` first, as in every other server
process, then SGLang's own app, unchanged."""
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.entrypoints.http_server import app  # noqa: E402,F401
