"""A bare streamed `/v1/completions` client for the serving benchmarks: raw asyncio, no HTTP
library, so that the client's own cost stays small beside the server it measures."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any


async def completion_events(
    host: str, port: int, body: dict[str, Any]
) -> AsyncIterator[tuple[float, bytes]]:
    """POST `body` (a streamed completion) and yield each server-sent event's payload (what
    follows `data: `) with the time its bytes arrived, until `[DONE]` or the connection ends."""
    reader, writer = await asyncio.open_connection(host, port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(raw)).encode()
                 + b"\r\n\r\n" + raw)  # fmt: skip
    await writer.drain()
    buf = b""
    try:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            now = time.perf_counter()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                at = ev.find(b"data: ")
                if at < 0:
                    continue
                data = ev[at + 6 :]
                if data.startswith(b"[DONE]"):
                    return
                yield now, data
    finally:
        writer.close()
