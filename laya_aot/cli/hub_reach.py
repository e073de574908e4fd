"""Whether the Hugging Face Hub can be reached, asked once with a short timeout.

Without network, huggingface_hub retries each request with backoff and then retries the metadata call
with a longer timeout, logging every attempt: `laya-aot fetch hf://...` printed 53 s of retry warnings,
each twice, before its one-line error. `laya-aot fetch` asks here first; when the Hub does not answer it
says so once and lets huggingface_hub read its local cache only (HF_HUB_OFFLINE=1), so a cached bundle is
still found and a missing one is one message naming the fix.
"""
from __future__ import annotations

import os
import socket
from typing import Optional
from urllib.parse import urlparse

_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def unreachable(timeout: float = 3.0) -> Optional[str]:
    """Why the Hub's endpoint (HF_ENDPOINT) does not answer a TCP connection, or None when it does, when
    offline mode is already asked for, or behind a proxy (only the proxy knows the way)."""
    if offline_requested() or any(os.environ.get(p) for p in _PROXIES):
        return None
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    host = url.hostname or endpoint
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return "%s does not answer (%s)" % (endpoint, e.strerror or type(e).__name__)
    return None
