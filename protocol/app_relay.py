"""The agent's app relay, authenticated per node (issue 37.2): what the web proves when it opens a
connection to a node's relay (agent.session_apps: a TCP listener on the node's `app-address` that
pipes each connection to a session's app), so that nobody on the network but the web can use it.

The proof is one line the web writes first on each connection, before any byte of HTTP:

    FGPU-RELAY/1 <ts: epoch ms> <nonce: 16 hex digits> <sig: 64 hex digits>\\r\\n

`sig` is HMAC-SHA256 under the node's relay key of `app-relay\\n<node>\\n<session id>\\n<app>\\n<ts>\\n<nonce>`:
it names the relay's session and app, so a proof for one app opens no other. The agent
(`RelayGuard.check`) pipes the connection to the app only when the line verifies, `ts` is within
MAX_AGE_S of its clock and the nonce was not seen in that time; else it closes the connection
without a byte to or from the app. No round trip: the web does not wait for an answer before it
writes its request (as protocol.channel's seals, a timestamp and a nonce instead of a challenge).

The relay key: where the node has an agent key (`manage.py node_key`, agent.toml `[manager]
node-key`), `relay_key(node_key)`, derived on both sides and never sent anywhere; the web reads
the node's key from the database (sessions.lifecycle.agent_links). A node without one makes a
random key when its agent starts (`RelayGuard.new_random`) and hands it to the web in its app
answers (`RELAY_KEY`, on the channel layer, whose reply channels only the web reads: common.broker_acl),
so the relay is still closed to the network, if not to whoever reads the broker's traffic (which
a node without a key leaves open to forged commands anyway).

Taken from Backend.AI's app proxy in spirit (its coordinator and workers share a secret and each
request carries a token signed under it, checked before anything is forwarded); ours is a line
on a raw TCP connection because the relay forwards any protocol (HTTP, websockets) unparsed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict

MAGIC = b"FGPU-RELAY/1"
MAX_AGE_S = 60  # a proof older (or newer) than this by the agent's clock is refused
HELLO_TIMEOUT_S = 5.0  # a connection that proves nothing within this time is closed
HELLO_MAX_BYTES = 128  # the proof line is 100 bytes; a longer first line is refused
NONCES_MAX = 100_000  # the most nonces a relay guard remembers
RELAY_KEY = "relay_key"  # the field of an agent's app answer that carries its random relay key (no node key)
RELAYED = "relayed"  # the field of an agent's app answer that says the address is its relay's
_LINE = re.compile(rb"FGPU-RELAY/1 (\d{1,15}) ([0-9a-f]{16}) ([0-9a-f]{64})\r?\n")


class RelayRefused(ValueError):
    """A connection whose first line is not a valid proof for this relay (the text says why; logged)."""


def relay_key(node_key: str) -> str:
    """The relay key of a node whose agent key is `node_key` (hex; HMAC-SHA256 of a fixed label
    under the key, so the relay key opens nothing the node key does)."""
    return hmac.new(node_key.encode(), b"fgpu app relay", hashlib.sha256).hexdigest()


def _sig(key: str, *, node: str, session_id: str, app: str, ts: int, nonce: str) -> str:
    text = f"app-relay\n{node}\n{session_id}\n{app}\n{ts}\n{nonce}"
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def relay_hello(key: str, *, node: str, session_id: str, app: str, now: float | None = None) -> bytes:
    """The line the web writes first on a new connection to the relay of `app` of `session_id` on
    `node`, proven under `key` (the node's relay key)."""
    ts = int((time.time() if now is None else now) * 1000)
    nonce = secrets.token_hex(8)
    sig = _sig(key, node=node, session_id=session_id, app=app, ts=ts, nonce=nonce)
    return b"%s %d %s %s\r\n" % (MAGIC, ts, nonce.encode(), sig.encode())


class RelayGuard:
    """The agent's side: `key` its relay key (`relay_key(node key)`, or `new_random()`), `shared`
    whether the web has to be told it (a random one: `answer_fields`)."""

    def __init__(self, *, node: str, key: str, shared: bool = False) -> None:
        self.node, self.key, self.shared = node, key, shared
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce → when it may be forgotten (epoch s)

    @classmethod
    def for_node(cls, *, node: str, node_key: str) -> RelayGuard:
        """The guard of an agent with agent key `node_key` ("" : a random relay key, told to the web)."""
        if node_key:
            return cls(node=node, key=relay_key(node_key))
        return cls(node=node, key=secrets.token_hex(32), shared=True)

    def answer_fields(self) -> dict[str, object]:
        """What an app answer that names the relay carries besides host and port."""
        return {RELAYED: True, **({RELAY_KEY: self.key} if self.shared else {})}

    def check(self, line: bytes, *, session_id: str, app: str, now: float | None = None) -> None:
        """Accept `line` (the connection's first line, its end of line included) as a proof for
        `app` of `session_id`, once. Raises RelayRefused (malformed, bad signature, stale, replayed)."""
        now = time.time() if now is None else now
        found = _LINE.fullmatch(line)
        if found is None:
            raise RelayRefused("no relay proof")
        ts, nonce, sig = int(found[1]), found[2].decode(), found[3].decode()
        expected = _sig(self.key, node=self.node, session_id=session_id, app=app, ts=ts, nonce=nonce)
        if not hmac.compare_digest(expected, sig):
            raise RelayRefused("the proof does not verify")
        if abs(now - ts / 1000) > MAX_AGE_S:
            raise RelayRefused("the proof is stale")
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= NONCES_MAX):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise RelayRefused("the proof was used already")
        self._seen[nonce] = now + 2 * MAX_AGE_S
