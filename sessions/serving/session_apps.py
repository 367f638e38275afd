"""Session apps (issue 16): the web apps a session's image declares (`SessionImage.apps`, e.g.
JupyterLab), started on demand inside the session by its agent and served through the
console's own proxy (`sessions.serving.proxy`) under `/sessions/<id>/apps/<name>/`.

Transport, as exec's (`sessions.lifecycle.services.session_exec`): the web sends `pty.app_open` to the
session's `pty.<node>.<id>` group (only its agent joins it) with a fresh reply channel; the agent
(agent.session_apps) starts the app's command if it does not run yet, and answers `app.progress`
{text} while it waits for the app's port, then `app.ready` {host, port, reused} or
`app.failed` {error, output}. `pty.app_status` asks where a running app listens (`app.status`
{running, host, port, error}); a web process keeps the answer (APP_TARGETS) for TARGET_TTL_S, or
until a connection to it fails. How a web process reaches an app on a node: the agent answers an address the web
hosts can reach: the node's `[container] app-address` (process runtime: the app listens there)
or the session container's address (docker runtime: on the node's container network), or, where the
node's agent relays (agent.toml `app-relay`, on by default where `app-address` is not loopback),
the agent's relay on `app-address` (agent.session_apps), which the web's connections prove
themselves to under the node's relay key (protocol.app_relay; sessions.serving.relay_connect).

The app's token (Jupyter's `--IdentityProvider.token`) is random, 48 hex characters
(secrets.token_hex), chosen by the web for each start of the app and never derived from a key: the
open message carries a new one (`token`) and the one the web holds (`keep`, "" if none); the agent
keeps an app that runs with `keep`, and starts it anew with `token` otherwise (it was not running,
or runs with a token the web no longer holds). The web keeps the token of the running app in
Django's cache (Redis in the distributed stack: every web process finds it; `app_token_get`) for
FGPU_APP_TOKEN_TTL after its last open; the proxy sends it upstream in `Authorization: token …`;
no page or API answer carries it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache

from common.errors import ApplicationError
from protocol.app_relay import RELAY_KEY, RELAYED, relay_key
from protocol.channel import AgentLink, Refused, reply_prefix
from sessions.lifecycle.agent_links import agent_link_of_session
from sessions.models import TERMINAL_APP, ComputeSession, SessionStatus
from sessions.serving.relay_connect import RelayProof, relay_remember
from sessions.service_ports import jupyter_app, merged_apps  # noqa: F401  (jupyter_app: imported from here too)

log = logging.getLogger(__name__)

APP_PREFIX = "/sessions/{session}/apps/{app}/"
OPEN_PAGE = "/sessions/{session}/open/{app}/"
REPLY_GRACE_S = 15  # how much longer than the app's own timeout the web waits for the agent's answer
STATUS_WAIT_S = 5  # how long a proxy waits for the agent to say where a running app listens
# (session id, app) → (host, port, until): where a web process last heard each app listens, kept
# TARGET_TTL_S (an app restarted meanwhile may listen elsewhere, its old port another's), at most MAX_TARGETS.
APP_TARGETS: dict[tuple[str, str], tuple[str, int, float]] = {}
TARGET_TTL_S = 30.0
MAX_TARGETS = 10_000
DEFAULT_TIMEOUT_S = 60


TOKEN_KEY = "fgpu-app-token:{session}:{app}"


def app_token_new() -> str:
    """A new app token: 48 random hex characters (secrets.token_hex(24), 192 bits)."""
    return secrets.token_hex(24)


async def app_token_get(*, session_id, app: str) -> str | None:
    """The token app `app` of session `session_id` was last started with (by any web process);
    None when no web process opened it (or FGPU_APP_TOKEN_TTL passed since)."""
    return await cache.aget(TOKEN_KEY.format(session=session_id, app=app))


# (session id, app) → when this process last kept a token for it (a number from _OPENINGS, growing):
# the app proxy takes a check it keeps (with the token it read) only while this is what it was then.
_OPENED: dict[tuple[str, str], int] = {}
_OPENINGS = itertools.count(1)


def app_opened(*, session_id, app: str) -> int:
    """When this process last kept a new token for app `app` of session `session_id` (a number
    that grows with each keep; 0: not since it started, or forgotten among MAX_TARGETS others).
    The app proxy keeps a passed check with the token it read only while this stays the same
    (sessions.serving.proxy._check)."""
    return _OPENED.get((str(session_id), app), 0)


async def _app_token_keep(*, session_id, app: str, token: str) -> None:
    await cache.aset(TOKEN_KEY.format(session=session_id, app=app), token, settings.FGPU_APP_TOKEN_TTL)
    key = (str(session_id), app)
    _OPENED.pop(key, None)
    while len(_OPENED) >= MAX_TARGETS:  # the oldest first: a forgotten one reads 0, and a kept check is taken anew
        _OPENED.pop(next(iter(_OPENED)))
    _OPENED[key] = next(_OPENINGS)


def app_prefix(*, session_id, app: str) -> str:
    """The app's place on the console: "/sessions/<id>/apps/<name>/"."""
    return APP_PREFIX.format(session=session_id, app=app)


def session_apps(session: ComputeSession) -> list[dict]:
    """The apps of `session`'s image (its record's, then its `ai.backend.service-ports` label's:
    sessions.service_ports.merged_apps) with their defaults filled in (`title`: the name, `protocol`
    "http", `base_url` true, `path` "", `timeout` DEFAULT_TIMEOUT_S); [] for a session without an
    image. The built-in terminal is not among them."""
    image = session.image
    apps = merged_apps(image.apps if isinstance(image.apps, list) else [], image.labels) if image is not None else []
    return [
        {"title": app["name"], "protocol": "http", "base_url": True, "path": "", "timeout": DEFAULT_TIMEOUT_S, **app}
        for app in apps
        if isinstance(app, dict) and app.get("name") != TERMINAL_APP
    ]


def session_app_links(session: ComputeSession) -> list[dict]:
    """What the pages and the session API show of its apps: `[{"name", "title", "url"}]`, `url`
    the page that starts the app and then opens it ("/sessions/<id>/open/<name>/")."""
    return [
        {"name": app["name"], "title": app["title"], "url": OPEN_PAGE.format(session=session.pk, app=app["name"])}
        for app in session_apps(session)
    ]


def session_app_get(*, session: ComputeSession, name: str) -> dict:
    """App `name` of `session`'s image. Raises ApplicationError 404 (type "unknown-app")."""
    for app in session_apps(session):
        if app["name"] == name:
            return app
    raise ApplicationError(f"the session's image offers no app {name!r}", type="unknown-app", title="Unknown app", status=404)


def _check_running(session: ComputeSession) -> None:
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(
            f"the session is {session.status}; its apps run only while it is RUNNING",
            type="session-not-running",
            title="Session not running",
            status=409,
        )


def app_open_message(*, session: ComputeSession, app: dict, token: str, keep: str | None) -> dict:
    """The `pty.app_open` message that starts `app` in `session` (without its reply channel):
    `token` the new token for a start, `keep` the one the web holds for a running app ("" if none)."""
    return {
        "type": "pty.app_open",
        "session_id": str(session.pk),
        "timeout": app["timeout"],
        "app": {key: app[key] for key in ("name", "command", "port", "base_url")},
        "base_url": app_prefix(session_id=session.pk, app=app["name"]),
        "token": token,
        "keep": keep or "",
    }


async def session_app_open(*, session: ComputeSession, app: dict, node: str, on_progress=None) -> dict:
    """Start `app` (from `session_app_get`) in RUNNING `session` on its node `node` if it does not run
    yet, and wait until its port answers; `on_progress(text)` (async) is called with each word of
    progress. Returns `{"url", "reused"}` (`url`: its path, which the console's origin hands on
    to the apps origin with a ticket (sessions.serving.origin); `reused`: it was running already).
    A start gets a new random token (kept for the proxy once the app answers); a running app keeps its own.

    Raises ApplicationError: 409 "session-not-running"; 502 "app-failed" when its command exited
    or its port did not answer within its timeout (`detail` says which and ends with the app's
    last output); 504 "app-timeout" when the agent did not answer within the app's timeout +
    REPLY_GRACE_S."""
    _check_running(session)
    keep = await app_token_get(session_id=session.pk, app=app["name"])
    token = app_token_new()
    layer = get_channel_layer()
    link = await sync_to_async(agent_link_of_session)(session.pk)  # seals the open, verifies answers
    if link is None:
        raise ApplicationError(
            "the session is not on a node", type="session-not-running", title="Session not running", status=409
        )
    reply = await layer.new_channel(reply_prefix("app"))
    message = app_open_message(session=session, app=app, token=token, keep=keep)
    await layer.group_send(link.pty_group(session.pk), link.command({**message, "reply_channel": reply}))
    wait_s = app["timeout"] + REPLY_GRACE_S
    try:
        async with asyncio.timeout(wait_s):
            while True:
                answer = await _verified(link, await layer.receive(reply))
                kind = answer.get("type")
                if kind == "app.progress" and on_progress is not None:
                    await on_progress(str(answer.get("text", "")))
                elif kind == "app.ready":
                    reused = bool(keep) and bool(answer.get("reused"))
                    held = keep if reused and keep else token  # a reused app runs with the held one
                    await _app_token_keep(session_id=session.pk, app=app["name"], token=held)
                    _remember((str(session.pk), app["name"]), answer, link)
                    url = app_prefix(session_id=session.pk, app=app["name"]) + app["path"]
                    return {"url": url, "reused": reused}
                elif kind == "app.failed":
                    output = str(answer.get("output") or "").rstrip()
                    detail = str(answer.get("error") or "the app failed to start")
                    raise ApplicationError(
                        detail + (f"; its last output:\n{output}" if output else ""),
                        type="app-failed",
                        title="App failed to start",
                        status=502,
                    )
    except TimeoutError:
        raise ApplicationError(
            f"the agent on {node} did not answer within {wait_s} s; is the node up?",
            type="app-timeout",
            title="App start timed out",
            status=504,
        ) from None


async def session_app_target(*, session_id: str, name: str, port: int | None = None) -> tuple[str, int] | dict:
    """Where app `name` of RUNNING session `session_id` listens, `(host, port)`: this process's
    cache, else the agent's answer to `pty.app_status` (kept). A dict `{"error": …}` when it does
    not run (the agent's words: "exited with code 1", "not started") or the agent is silent.
    `port`: the app's declared port, with which an agent adopts an app that outlived it in a container."""
    key = (str(session_id), name)
    known = APP_TARGETS.get(key)
    if known is not None and known[2] > time.monotonic():
        return known[0], known[1]
    layer = get_channel_layer()
    link = await sync_to_async(agent_link_of_session)(session_id)
    if link is None:
        return {"error": "the session is not on a node"}
    reply = await layer.new_channel(reply_prefix("app"))
    await layer.group_send(
        link.pty_group(session_id),
        link.command(
            {"type": "pty.app_status", "session_id": str(session_id), "name": name, "port": port, "reply_channel": reply}
        ),
    )
    try:
        async with asyncio.timeout(STATUS_WAIT_S):
            while True:
                answer = await _verified(link, await layer.receive(reply))
                if answer.get("type") == "app.status":
                    break
    except TimeoutError:
        return {"error": f"the session's agent did not answer within {STATUS_WAIT_S} s"}
    if not answer.get("running"):
        return {"error": str(answer.get("error") or "it is not running")}
    return _remember(key, answer, link)


async def _verified(link: AgentLink, answer: dict) -> dict:
    """The agent's `answer` once its node's key verifies it (protocol.channel); else `{}` (logged):
    a listener named by a forged answer never gets a user's request."""
    try:
        return link.answer(answer)
    except Refused as exc:
        log.warning("ignored an app answer claiming to come from node %s: %s", link.node, exc)
        return {}


def _remember(key: tuple[str, str], answer: dict, link: AgentLink) -> tuple[str, int]:
    """Keep where the agent's `answer` says app `key` (session id, name) listens; where that is the
    agent's relay, its proof too (protocol.app_relay: the node's relay key, from its agent key or
    else the random key the answer carries)."""
    host, port = str(answer["host"]), int(answer["port"])
    proof = None
    if answer.get(RELAYED):
        secret = relay_key(link.key) if link.key else str(answer.get(RELAY_KEY) or "")
        proof = RelayProof(key=secret, node=link.node, session_id=key[0], app=key[1])
    relay_remember(host, port, proof)
    APP_TARGETS.pop(key, None)
    while len(APP_TARGETS) >= MAX_TARGETS:  # the oldest first
        APP_TARGETS.pop(next(iter(APP_TARGETS)))
    APP_TARGETS[key] = (host, port, time.monotonic() + TARGET_TTL_S)
    return host, port


def session_app_target_forget(*, session_id: str, name: str) -> None:
    """Forget where the app listens (a connection to it failed): the next request asks the agent."""
    APP_TARGETS.pop((str(session_id), name), None)
