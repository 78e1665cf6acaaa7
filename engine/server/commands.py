"""The WebSocket commands (docs/protocol.md), in the API process: `CommandHandler` turns a
client's frame into a request to the engine process and answers the client. It runs on the
publisher's thread; tokenizing runs on a worker thread so a long prompt holds up no other client.
"""

from __future__ import annotations

import asyncio
import logging

from engine.config import POLICY_NAMES
from engine.server.client import EngineClient, EngineGone
from instrumentation import messages
from instrumentation.commands import (
    Abort,
    CommandError,
    KVMap,
    SetConfig,
    Stats,
    Submit,
    parse_command,
)
from instrumentation.errors import EngineError
from instrumentation.publisher import Client, Publisher

log = logging.getLogger("stepscope.server")


class CommandHandler:
    """One client frame → one engine call → a reply (or, for set_config, a broadcast)."""

    def __init__(self, engine: EngineClient, publisher: Publisher) -> None:
        self.engine = engine
        self.publisher = publisher

    async def on_frame(self, client: Client, frame: str | bytes) -> None:
        try:
            cmd = parse_command(frame, vocab_size=self.engine.info.vocab_size,
                                policies=POLICY_NAMES)  # fmt: skip
        except CommandError as exc:
            self.publisher.reply(client, messages.error(exc.command_id, exc.code, exc.message))
            return
        try:
            if isinstance(cmd, Submit):
                ids = await asyncio.to_thread(self.engine.encode, cmd.prompt, cmd.chat)
                (uid,) = await self.engine.call("submit", requests=[(ids, cmd.params)], source=None)
                self.publisher.reply(client, messages.accepted(cmd.id, uid))
            elif isinstance(cmd, Abort):
                await self.engine.call("abort", uid=cmd.uid)
                # the sender hears at once; every client sees the `aborted` event that follows
                self.publisher.reply(client, messages.accepted(cmd.id, cmd.uid))
            elif isinstance(cmd, SetConfig):
                # the engine broadcasts the `config` message, in order with its events
                await self.engine.call("set_config", command_id=cmd.id,
                                       max_extend_tokens=cmd.max_extend_tokens, policy=cmd.policy,
                                       admission=cmd.admission)  # fmt: skip
            elif isinstance(cmd, Stats):
                values = await self.engine.call("stats", timeout=None)
                values.update(self.publisher.counters())
                self.publisher.reply(client, messages.stats(cmd.id, self.engine.now(), values))
            elif isinstance(cmd, KVMap):
                values = await self.engine.call("read", name="kv_map", timeout=None)
                self.publisher.reply(client, messages.kv_map(cmd.id, values.pop("t"), values))
        except EngineError as exc:
            code = exc.code if exc.code in messages.ERROR_CODES else "invalid_request"
            self.publisher.reply(client, messages.error(cmd.id, code, str(exc)))  # type: ignore[arg-type]
        except EngineGone as exc:
            self.publisher.reply(client, messages.error(cmd.id, "invalid_request", str(exc)))
        except Exception:  # a bug here must still answer, and must not reach the engine
            log.exception("command %r failed", type(cmd).__name__)
            reason = "the server could not carry out this command"
            self.publisher.reply(client, messages.error(cmd.id, "invalid_request", reason))
