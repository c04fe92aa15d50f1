"""Who may use the head's OpenAI API: the API key rule and the bind address.

The head serves the API on every interface by default (host networking), so it refuses to
start without `VLLM_API_KEY` unless the node says `ALLOW_UNAUTHENTICATED_API=1`. The key's
value is never printed, only its length. `API_HOST` picks the bind address: empty (the
profile's `serving.host`, 0.0.0.0 on the Sparks), this node's LAN address, or 127.0.0.1
behind a reverse proxy on the same host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .report import Report

MIN_KEY_CHARS = 16
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: one HTTP bearer token
_IPV4 = re.compile(r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}")
KEY_FIX = "set VLLM_API_KEY in docker/.env to a random token, e.g. the output of: openssl rand -hex 32"


def bind_host(value: str) -> str | None:
    """Why `value` cannot be an API bind address (API_HOST or --api-host), or None."""
    if not _IPV4.fullmatch(value):
        return (f"'{value}' is not an IPv4 address; expected 0.0.0.0 (all interfaces), this "
                "node's LAN address, or 127.0.0.1 (behind a reverse proxy on this host)")
    return None


def check(env: Mapping[str, str], report: Report) -> None:
    """FAIL lines for an unusable key or bind address, and for a head that would be open."""
    key, allow = env.get("VLLM_API_KEY", ""), env.get("ALLOW_UNAUTHENTICATED_API", "")
    if allow not in ("", "0", "1"):
        report.fail("env", f"ALLOW_UNAUTHENTICATED_API='{allow}' is not 0 or 1",
                    "leave it empty or 0 (an API key is required); 1 only on an isolated network")
    if key and (len(key) < MIN_KEY_CHARS or not _KEY.fullmatch(key)):
        report.fail("env", f"VLLM_API_KEY (value hidden, {len(key)} characters) is not one token "
                    f"of at least {MIN_KEY_CHARS} printable ASCII characters without spaces",
                    KEY_FIX)
    host = env.get("API_HOST", "")
    if host and bind_host(host):
        report.fail("env", f"API_HOST={bind_host(host)}",
                    "leave API_HOST empty for the profile's address (0.0.0.0 on the Sparks)")
    if env.get("NODE_RANK") != "0" or key:
        return
    if allow == "1":
        where = host or "the profile's address (every interface on the Sparks)"
        report.warn("env", f"ALLOW_UNAUTHENTICATED_API=1: anyone who reaches {where} can use "
                    "the model without a key")
        return
    report.fail("env", "VLLM_API_KEY is empty: the head would serve the model to anyone on any "
                "network this node is on", KEY_FIX,
                "or, only on an isolated network, set ALLOW_UNAUTHENTICATED_API=1")
