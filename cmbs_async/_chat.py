"""The one chat-completions call, shared by the language-model agent and the stock reviewer:
any OpenAI-compatible ``/chat/completions`` endpoint, over one HTTP client."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import anyio
import httpx

from ._closing import Closing

__all__ = ["ChatEndpoint", "completion_content"]


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
        doubling up to 5 s), then raised. Any HTTP status is returned, not raised."""
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
                return await self._client.post(
                    self.url, json=body, headers=headers, timeout=self.request_timeout
                )
            except httpx.TransportError:
                if attempt == retries:
                    raise
            await anyio.sleep(min(0.5 * 2**attempt, 5))
            attempt += 1

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
