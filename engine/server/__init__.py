"""The server: the one package that wires the engine to the instrumentation layer.

`python -m engine.server` runs the composition root (core.py): the engine loop, the WebSocket
publisher and the trace writer; the HTTP routes (OpenAI API, /health, /metrics) are in
openai_api.py, openai_app.py and prometheus.py.
"""

from engine.server.core import EngineLoop, build, build_parser, main

__all__ = ["EngineLoop", "build", "build_parser", "main"]
