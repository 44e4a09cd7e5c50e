"""The one chat-completions call, shared by the language-model agent and the stock reviewer:
any OpenAI-compatible ``/chat/completions`` endpoint, over one HTTP client."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

import anyio
import httpx

from ._closing import Closing
from ._errors import CmbsError
from ._reading import size_text

__all__ = ["REPLY_MAX_BYTES", "ChatEndpoint", "completion_content"]

#: The largest reply read from a chat endpoint (a model's step is capped at 4 MiB anyway).
REPLY_MAX_BYTES = 16 << 20
#: headers that described the body as it came, not as it is kept (decoded, whole)
_DECODED = {"content-encoding", "content-length", "transfer-encoding"}


class _ReplyTooLarge(CmbsError, httpx.DecodingError):
    """A chat endpoint's reply over :data:`REPLY_MAX_BYTES`: not read further."""


class ChatEndpoint(Closing):
    """POSTs chat-completion requests to ``base_url``, with the key read from the
    environment variable ``api_key_env`` at each request (never stored), each request
    bounded by ``request_timeout`` seconds (``None``: the caller bounds it).

    Over ``client`` when one is given (its creator closes it); else over a client of its
    own, opened on first use and closed by :meth:`aclose` or at the end of ``async with``.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key_env: str,
        request_timeout: float | None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = f"{base_url.rstrip('/')}/chat/completions"
        self.api_key_env = api_key_env
        self.request_timeout = request_timeout
        self.requests = 0  # attempts sent, retries included
        self._client = client
        self._own_client = client is None

    async def post(self, body: Mapping[str, Any], *, retries: int = 0) -> httpx.Response:
        """Send ``body``; a transport error is retried ``retries`` times (after 0.5 s,
        doubling up to 5 s), then raised. Any HTTP status is returned, not raised. A reply
        over :data:`REPLY_MAX_BYTES` is never read whole: an ``httpx.DecodingError``."""
        headers = {}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if self._client is None:
            self._client = httpx.AsyncClient()
        attempt = 0
        while True:
            self.requests += 1
            try:
                return await self._capped(body, headers)
            except httpx.TransportError:
                if attempt == retries:
                    raise
            await anyio.sleep(min(0.5 * 2**attempt, 5))
            attempt += 1

    async def _capped(self, body: Mapping[str, Any], headers: dict[str, str]) -> httpx.Response:
        """The reply to ``body``, read up to :data:`REPLY_MAX_BYTES` (decoded)."""
        assert self._client is not None
        async with self._client.stream(
            "POST", self.url, json=body, headers=headers, timeout=self.request_timeout
        ) as reply:
            too_large = _ReplyTooLarge(
                f"larger than {size_text(REPLY_MAX_BYTES)} (the cap for a chat endpoint's reply)",
                request=reply.request,
            )
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > REPLY_MAX_BYTES:
                raise too_large  # said before a byte of it is read
            data = bytearray()
            chunks = cast(AsyncGenerator[bytes, None], reply.aiter_bytes())
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:  # decoded: a compressed reply is capped as it grows
                    data += chunk
                    if len(data) > REPLY_MAX_BYTES:
                        raise too_large
        kept = [(k, v) for k, v in reply.headers.multi_items() if k.lower() not in _DECODED]
        return httpx.Response(
            reply.status_code, headers=kept, content=bytes(data), request=reply.request
        )

    async def aclose(self) -> None:
        """Close the client if it is this endpoint's own; safe to call twice."""
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            with anyio.CancelScope(shield=True):  # on a cancellation too: no socket left open
                await client.aclose()


def completion_content(reply: httpx.Response) -> object:
    """The first choice's message content; ``ValueError`` if ``reply`` is no chat completion."""
    try:
        return reply.json()["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError("not a chat completion") from exc
