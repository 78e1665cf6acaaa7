"""The server: the one package that wires the engine to the instrumentation layer.

`python -m engine.server` runs two processes. The engine process (core.py: the composition root,
its command line from the settings in args.py) runs the engine loop (loop.py) and the engine's
end of the wire (bridge.py, ipc.py). The API process it spawns (frontend.py) serves clients
over the engine's client (client.py): the WebSocket protocol (instrumentation's publisher, the
commands in commands.py), the HTTP routes (OpenAI API, SGLang's worker routes, /health,
/metrics: openai/, sglang/, metrics/, answering errors in the shape of errors.py) and the trace
writer. fleet.py launches replicas of it behind SGLang's Model Gateway.
"""

from engine.server.args import ServerArgs, build_parser, parse_args
from engine.server.core import build, main, serve
from engine.server.loop import EngineLoop

__all__ = ["EngineLoop", "ServerArgs", "build", "build_parser", "main", "parse_args", "serve"]
