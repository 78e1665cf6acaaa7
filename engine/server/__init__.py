"""The server: the one package that wires the engine to the instrumentation layer.

`python -m engine.server` runs the composition root (core.py): its command line comes from the
settings (args.py), the engine loop and WebSocket commands are in loop.py, the trace writer and
publisher are instrumentation's; the HTTP routes (OpenAI API, /health, /metrics) are in
openai_api.py, openai_app.py and prometheus.py.
"""

from engine.server.args import ServerArgs, build_parser, parse_args
from engine.server.core import build, main, serve
from engine.server.loop import EngineLoop

__all__ = ["EngineLoop", "ServerArgs", "build", "build_parser", "main", "parse_args", "serve"]
