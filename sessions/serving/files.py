"""A session's files from the web (issue 18, item 6): list, download, upload, delete and make
folders in a RUNNING session's home and its owner's persistent folder (`data/`).

Transport: `pty.files` messages to the session's `pty.<node>.<id>` group (which only its agent joins),
each answered on a reply channel (agent.files; message shapes in protocol.files), as exec is. So
it works wherever the terminal does: web processes and agents on different hosts share only the
channel layer (Redis), no address of the node is needed. File bytes travel in chunks of at most
CHUNK_BYTES (256 KiB): an upload is read from the request body chunk by chunk, one request and
one answer at a time (Django's ASGI handler holds it in a temporary file), and a download is streamed
to the client as the agent answers, READ_AHEAD (4) reads asked for at once, so a web process holds
one chunk per upload and at most four per download in memory.

Where the agent offers it (agent.files: its direct listener, agent.direct), the bytes skip the
layer: the download's first read and the upload's start ask `direct`, and the agent's answer holds
a one-time token for one TCP connection to it (as the terminal's direct stream, reached where
session apps are), which carries the whole file: sent by the agent with sendfile and relayed to
the client as it comes, or the request body sent on as the web server receives it, the agent
checking the same size and cap (sessions.serving.agent_stream connects). The commit, the errors
and the checks stay on the layer. Where the connection fails (DIRECT_CONNECT_S), the transfer
goes through the layer as before. Where
the agent runs on this web's own event loop (standalone), the same offer is taken in the process
(protocol.files.take_local) and the bytes pass as Python objects, no socket between the two.

Each service checks the path and the session and reads what it needs of the database (the
owner's projects) in sync code, then returns the wait: a coroutine function that talks to the
agent on the event loop and reads no database, so the API (common.api_async) holds no web
thread and no database connection while the agent answers. An upload's body is read by the
wait (from Django's temporary file: local, a chunk at a time).

Paths are checked here (protocol.files.path_parts, for a clear 400 naming `path`) and again on
the agent, which alone enforces confinement (O_NOFOLLOW from the root's descriptor). Uploads are
capped at FGPU_FILES_USER_CAP bytes per persistent folder (per user) and per session home.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections import deque
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from channels.layers import get_channel_layer
from django.conf import settings

from common.errors import ApplicationError
from protocol import files as proto
from protocol.channel import AgentLink, Refused, reply_prefix
from protocol.terminal_stream import DIRECT_OK
from accelerators.models import NodeStatus
from sessions.lifecycle import events
from sessions.models import ComputeSession, SessionStatus
from sessions.policy.shares import shared_mounts, shared_path_check
from sessions.serving.agent_stream import agent_stream_open

log = logging.getLogger(__name__)
DIRECT_CONNECT_S = 2.0  # connecting to the agent's listener for a transfer and its first answer, at most
DIRECT_PIECE = 1024 * 1024  # what a direct transfer reads (socket, request body) at a time, bytes
READ_AHEAD = 4  # a download's reads asked for at once: at most READ_AHEAD × CHUNK_BYTES (1 MiB) held per transfer

REPLY_WAIT_S = 30  # how long the web waits for the agent's answer to one op
BEGIN_WAIT_S = 120  # an upload's start measures the folder against the cap: it may take longer

T = TypeVar("T")
Wait = Callable[[], Awaitable[T]]  # what a service returns: awaited on the event loop, it reads no database

TITLES = {
    "bad-path": "Path refused",
    "symlink": "Path refused",
    "not-found": "No such file",
    "not-a-directory": "Not a folder",
    "is-a-directory": "Is a folder",
    "not-a-file": "Not a regular file",
    "exists": "Exists",
    "read-only": "Read-only",
    "over-cap": "Over the cap",
    "no-data-folder": "No persistent folder",
    "upload-gone": "Upload abandoned",
    "failed": "File operation failed",
}


def _path_refused(detail: str, why: str | None = None) -> ApplicationError:
    """The 400 "bad-path" (Path refused) saying `detail`, naming the field `path` with `why`
    (default `detail`)."""
    return ApplicationError(detail, type="bad-path", title="Path refused", field_errors={"path": [why or detail]})


def path_check(path: str, *, empty: tuple[str, str] | None = None) -> list[str]:
    """The parts of `path` (protocol.files.path_parts). Raises ApplicationError 400 "bad-path"
    naming the field `path`; where `empty` is given, also for the home itself (no parts),
    saying `empty` (detail, why)."""
    try:
        parts = proto.path_parts(path)
    except proto.PathRefused as exc:
        raise _path_refused(str(exc)) from None
    if empty is not None and not parts:
        raise _path_refused(*empty)
    return parts


def _check_running(session: ComputeSession) -> None:
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(
            f"the session is {session.status}; its files are reached only while it is RUNNING",
            type="session-not-running",
            title="Session not running",
            status=409,
        )


def _check_node_up(session: ComputeSession) -> None:
    """Raises ApplicationError 503 "node-down" when the session's node is LOST (no heartbeat within
    the timeout): its files are reached only through its agent, and the answer says where its data
    folders are (on the shared storage, or local to that node: Node.shared_storage, issue 37.3)
    instead of letting the caller wait REPLY_WAIT_S for an agent that is not there."""
    node = session.node
    if node is None or node.status != NodeStatus.LOST:
        return
    since = f" since {node.last_heartbeat:%Y-%m-%d %H:%M:%S} UTC" if node.last_heartbeat else ""
    where = (
        "its data folders are on the shared storage and come back with any session on another node"
        if node.shared_storage
        else "its ~/data and project folders are local to that node (no shared storage) and come back with it"
    )
    raise ApplicationError(
        f"node {node.name} is down (no heartbeat{since}): the session's files are reached only through its agent; {where}",
        type="node-down",
        title="Node down",
        status=503,
    )


def _refusal(node: str, answer: dict | None, wait_s: float) -> ApplicationError:
    if answer is None:
        return ApplicationError(
            f"the agent on {node} did not answer within {wait_s:.0f} s; is the node up?",
            type="files-timeout",
            title="Agent did not answer",
            status=504,
        )
    code = answer.get("error", "failed")
    return ApplicationError(
        answer.get("detail", "the file operation failed"),
        type=code,
        title=TITLES.get(code, "File operation failed"),
        status=proto.ERRORS.get(code, 502),
        field_errors={"path": [answer.get("detail", "")]} if code in ("bad-path", "symlink") else None,
    )


def _owner_projects(session: ComputeSession) -> dict[str, str]:
    """name → id of the projects the session's owner is a member of now: the `projects/<name>`
    folders the agent resolves (agent.files.project_folders)."""
    return {name: str(pk) for pk, name in session.owner.projects.values_list("pk", "name")}


@dataclass(frozen=True)
class FilesCall:
    """What the waits need of a RUNNING session, read in sync code before they start (they run
    on the event loop and read no database): its id, its owner's id, the owner's projects
    (`_owner_projects`), its node's name (for errors), the cap (bytes) an upload is held to and
    the folders shared with the owner now ({name: {kind, id, read_only}}: `shared/<name>`,
    sessions.policy.shares)."""

    session_id: str
    owner_id: int
    projects: dict[str, str]
    node: str
    cap: int
    link: AgentLink | None = None  # the node's (protocol.channel): seals each op, verifies each answer
    shared: dict[str, dict] | None = None


def _call(session: ComputeSession, *, parts: list[str], write: bool = False) -> FilesCall:
    """The session's FilesCall for the path of `parts`: three queries (the owner's projects, the
    folders shared with them). Raises ApplicationError 409 session-not-running, 503 node-down
    (`_check_node_up`); under shared/,
    404 not-found (no such share: a revoked one is gone at once) and, for a `write`, 403
    read-only (a read-only share; sessions.policy.shares.shared_path_check)."""
    _check_running(session)
    _check_node_up(session)
    shared = {m.name: m.encode() for m in shared_mounts(user_id=session.owner_id)}
    shared_path_check(mounts=shared, path_parts=parts, write=write)
    return FilesCall(
        session_id=str(session.pk),
        owner_id=session.owner_id,
        projects=_owner_projects(session),
        node=session.node.name if session.node else "its node",
        cap=settings.FGPU_FILES_USER_CAP,
        link=events.agent_link(session.node) if session.node else None,
        shared=shared,
    )


class _Link:
    """One reply channel to a session's agent, for a sequence of ops (an upload, a download)."""

    def __init__(self, call: FilesCall) -> None:
        self.call = call
        self.layer = get_channel_layer()
        self.reply: str | None = None

    async def ask(self, op: str, *, wait_s: float | None = None, **fields) -> dict:
        """Send op with `fields` and return the agent's answer; raises ApplicationError when it
        refuses or does not answer within `wait_s` seconds (default REPLY_WAIT_S)."""
        wait_s = REPLY_WAIT_S if wait_s is None else wait_s
        link = self.call.link or AgentLink(node=self.call.node)
        if self.reply is None:
            self.reply = await self.layer.new_channel(reply_prefix("files"))
        await self.layer.group_send(
            link.pty_group(self.call.session_id),
            link.command(
                {
                    "type": proto.FILES,
                    "session_id": self.call.session_id,
                    "owner_id": self.call.owner_id,
                    "projects": self.call.projects,
                    "shared": self.call.shared or {},
                    "op": op,
                    "reply_channel": self.reply,
                    **fields,
                }
            ),
        )
        answer = None
        try:
            async with asyncio.timeout(wait_s):
                while answer is None:
                    message = await self.layer.receive(self.reply)
                    try:
                        message = link.answer(message)
                    except Refused as exc:
                        log.warning("ignored a files answer claiming to come from node %s: %s", link.node, exc)
                        continue
                    if message.get("type") == proto.RESULT:
                        answer = message
        except TimeoutError:
            pass
        if answer is None or not answer.get("ok"):
            raise _refusal(self.call.node, answer, wait_s)
        return answer


def session_files_list(*, session: ComputeSession, path: str = "") -> Wait[dict]:
    """The wait for the folder `path` of a RUNNING session (relative to its home; `data/…` its
    owner's persistent folder): a coroutine function (no argument, awaited on the event loop; it
    reads no database) that returns `{"path", "entries": [{"name", "type": "dir" | "file" |
    "link" | "other", "size" (bytes), "mtime" (epoch s), "persistent"?}], "truncated"}`.

    Raises ApplicationError (this call: 400 bad-path, 409 session-not-running; the wait: 400
    symlink / not-a-directory, 404 not-found, 504 files-timeout when the agent did not answer
    within REPLY_WAIT_S seconds)."""
    call = _call(session, parts=path_check(path))

    async def wait() -> dict:
        answer = await _Link(call).ask("list", path=path)
        return {"path": answer["path"], "entries": answer["entries"], "truncated": answer["truncated"]}

    return wait


def session_file_delete(*, session: ComputeSession, path: str) -> Wait[None]:
    """The wait deleting the file, link (the link itself) or folder (with what it holds) at
    `path`. Raises as `session_files_list`, and 403 read-only (the wait: under `.fgpu/`; this call: in a
    read-only shared folder), 404 not-found (this call: a shared folder that is none)."""
    parts = path_check(path, empty=("give the path of a file or folder to delete", "the home itself cannot be deleted"))
    call = _call(session, parts=parts, write=True)

    async def wait() -> None:
        await _Link(call).ask("delete", path=path)

    return wait


def session_folder_make(*, session: ComputeSession, path: str) -> Wait[dict]:
    """The wait making the folder `path` (and its missing parents), which returns its entry.
    Raises as `session_files_list`."""
    parts = path_check(path, empty=("give the path of the folder to make", "the home exists"))
    call = _call(session, parts=parts, write=True)

    async def wait() -> dict:
        return (await _Link(call).ask("mkdir", path=path))["entry"]

    return wait


def session_file_upload(*, session: ComputeSession, path: str, body, size: int | None) -> Wait[dict]:
    """The wait writing the bytes of `body` (a file-like object: `read(n)`, a local file or
    memory: it is read on the event loop; or a common.request_body.RequestBody: the request's
    body as it arrives, `await read(n)`) to `path`, replacing a file there once all of it
    arrived (a failed upload leaves the old file and no partial one), which returns the new
    entry. `size`: the body's length in bytes when known (Content-Length).

    Raises ApplicationError as `session_files_list`, and 413 over-cap when the file would bring
    the folder past FGPU_FILES_USER_CAP bytes (this call, before a byte is sent, when `size`
    says so; else the wait), 400 is-a-directory (the wait) when `path` is a folder."""
    parts = path_check(path, empty=("give the path of the file to write", "a file name is needed"))
    call = _call(session, parts=parts, write=True)
    if size is not None and size > call.cap:
        raise ApplicationError(
            f"the file ({size} bytes) is larger than a folder may hold ({call.cap} bytes)",
            type="over-cap",
            title="Over the cap",
            status=413,
        )
    return partial(_upload, _Link(call), path, body, size)


async def _answer_line(reader: asyncio.StreamReader) -> dict:
    """The agent's line on a transfer's connection ({} where there is none or it is not JSON)."""
    try:
        async with asyncio.timeout(REPLY_WAIT_S):
            line = await reader.readline()
        found = json.loads(line) if line else {}
    except (ValueError, OSError, TimeoutError, asyncio.LimitOverrunError):
        return {}
    return found if isinstance(found, dict) else {}


def _incomplete(sent: int, size: int) -> ApplicationError:
    return ApplicationError(
        f"the request body ended after {sent} of its {size} bytes", type="bad-request", title="Incomplete upload"
    )


async def _upload_direct(link: _Link, offer: dict, body, size: int | None) -> int | None:
    """Send the whole of `body` for the upload (`offer`): to the agent in this process where it
    offered it here (protocol.files.take_local: standalone), else over the agent's connection;
    the bytes the agent wrote, or None where no connection came about before a byte was sent
    (the caller sends through the layer). Raises ApplicationError when the agent refused (its
    error: over-cap, …), the body ended short of `size` or the connection broke."""
    sent = 0

    async def pieces() -> AsyncIterator[bytes]:
        nonlocal sent
        while data := await _body_read(body, DIRECT_PIECE):
            sent += len(data)
            yield data
        if size is not None and sent != size:
            raise _incomplete(sent, size)

    local = proto.take_local(offer.get("token"))
    if local is not None:
        try:
            answer = await local(pieces())
        except proto.TransferRefused as exc:
            answer = {"error": exc.error, "detail": exc.detail}
    else:
        connection = await agent_stream_open(offer, timeout_s=DIRECT_CONNECT_S, what="file transfer")
        if connection is None:
            return None
        reader, writer = connection
        try:
            try:
                async for data in pieces():
                    writer.write(data)
                    await writer.drain()
                writer.write_eof()
            except ConnectionError:
                pass  # the agent refused and closed: its line says why
            answer = await _answer_line(reader)
        finally:
            writer.close()
    if answer.get("type") == DIRECT_OK and answer.get("written") == sent:
        return sent
    refused = {"ok": False, "error": answer.get("error", "failed"), "detail": answer.get("detail", "the upload broke off")}
    raise _refusal(link.call.node, refused, 0)


async def _body_read(body, n: int) -> bytes:
    """At most `n` bytes of `body` (b"" at its end): a common.request_body.RequestBody, awaited
    (the request's body as it arrives), or a file-like object, read on the loop (a local file or
    memory). Raises ApplicationError 400 when the client went away before the body's end."""
    try:
        data = body.read(n)
        if inspect.isawaitable(data):
            data = await data
    except ConnectionAbortedError:
        raise ApplicationError("the request body broke off", type="bad-request", title="Incomplete upload") from None
    return bytes(data)


async def _upload(link: _Link, path: str, body, size: int | None) -> dict:
    begun = await link.ask("upload_begin", path=path, size=size, cap=link.call.cap, wait_s=BEGIN_WAIT_S, direct=True)
    upload_id = begun["upload_id"]
    offset = 0
    try:
        if begun.get("direct"):
            written = await _upload_direct(link, begun["direct"], body, size)
            if written is not None:
                return (await link.ask("upload_commit", upload_id=upload_id))["entry"]
        while True:
            data = await _body_read(body, proto.CHUNK_BYTES)
            if not data:
                break
            await link.ask("upload_chunk", upload_id=upload_id, offset=offset, data=bytes(data))
            offset += len(data)
        if size is not None and offset != size:
            raise _incomplete(offset, size)
        return (await link.ask("upload_commit", upload_id=upload_id))["entry"]
    except BaseException:
        try:
            await link.ask("upload_abort", upload_id=upload_id)
        except ApplicationError:
            pass  # already gone (the agent dropped it on the refusal)
        raise


def session_file_download(*, session: ComputeSession, path: str) -> Wait[tuple[str, int, AsyncIterator[bytes]]]:
    """The wait starting to read the regular file at `path`, which returns `(name, size in
    bytes, chunks)` once the agent answered the first chunk, where `chunks` is an async iterator
    of bytes (at most CHUNK_BYTES each) that ends after `size` bytes, asking the agent for each
    in turn. Raises ApplicationError as `session_files_list` (before anything is sent), and 400
    is-a-directory / not-a-file; a failure later ends the iterator early (the client sees a
    short body)."""
    parts = path_check(path)
    if not parts:
        raise ApplicationError(
            "give the path of a file to download",
            type="is-a-directory",
            title="Is a folder",
            field_errors={"path": ["the home is a folder"]},
        )
    call = _call(session, parts=parts)

    async def wait() -> tuple[str, int, AsyncIterator[bytes]]:
        first = await _Link(call).ask("read", path=path, offset=0, length=proto.CHUNK_BYTES, direct=True)
        # the rest on a reply channel (or a connection) of its own: under a sync caller (the
        # test client) it is read on another loop than this wait's
        if isinstance(first.get("direct"), dict):
            return parts[-1], int(first["size"]), _direct_chunks(call, path, first)
        return parts[-1], int(first["size"]), _chunks(call, path, first)

    return wait


async def _direct_chunks(call: FilesCall, path: str, first: dict):
    """The download's bytes from the agent in this process where it offered them here
    (protocol.files.take_local: standalone; read from the file as the client takes them), else
    over the agent's connection (`first["direct"]`: agent.files sends them with sendfile), as
    they come, up to the size announced; through the layer (`_chunks`, up to that size) where the
    connection does not come about. Ends early (the client sees a short body) where the agent
    refuses or the connection breaks."""
    size = int(first["size"])
    local = proto.take_local(first["direct"].get("token"))
    if local is not None:
        left = size
        try:
            async with aclosing(local()) as pieces:  # its file closed at once where the client goes away
                async for data in pieces:
                    left -= len(data)
                    yield data
        except proto.TransferRefused as exc:
            log.warning("download of %r from session %s refused: %s", path, call.session_id, exc.detail)
            return
        if left > 0:
            log.warning("download of %r from session %s stopped at %d of %d bytes", path, call.session_id, size - left, size)
        return
    connection = await agent_stream_open(first["direct"], timeout_s=DIRECT_CONNECT_S, what="file transfer")
    if connection is None:
        again = await _Link(call).ask("read", path=path, offset=0, length=proto.CHUNK_BYTES)
        async for data in _chunks(call, path, {**again, "size": min(size, int(again["size"]))}):
            yield data
        return
    reader, writer = connection
    try:
        answer = await _answer_line(reader)
        if answer.get("type") != DIRECT_OK:
            log.warning("download of %r from session %s refused: %s", path, call.session_id, answer.get("detail", answer))
            return
        left = size
        while left > 0:
            data = await reader.read(min(DIRECT_PIECE, left))
            if not data:
                log.warning("download of %r from session %s stopped at %d of %d bytes", path, call.session_id, size - left, size)
                return
            left -= len(data)
            yield data
    finally:
        writer.close()


async def _chunks(call: FilesCall, path: str, first: dict):
    """The download's chunks after `first`, READ_AHEAD reads asked for at once (each on a reply
    channel of its own, so each answer is its own) while the client takes the chunk before: one
    read at a time left the agent idle for every round trip through the channel layer. A read
    that answers fewer bytes than asked (the file shrank) ends the download there."""
    size = int(first["size"])
    data = bytes(first["data"])[:size]
    links = [_Link(call) for _ in range(READ_AHEAD)]
    asked: deque[tuple[int, asyncio.Task]] = deque()  # (bytes expected, the read), in file order
    following, sent, turn = len(data), 0, 0  # the next offset to ask for, bytes given, reads asked
    try:
        while True:
            while data and len(asked) < READ_AHEAD and following < size:
                length = min(proto.CHUNK_BYTES, size - following)
                asking = links[turn % READ_AHEAD].ask("read", path=path, offset=following, length=proto.CHUNK_BYTES)
                asked.append((length, asyncio.ensure_future(asking)))
                following, turn = following + length, turn + 1
            if data:
                yield data
                sent += len(data)
            if sent >= size or not asked:
                return
            expected, reading = asked.popleft()
            try:
                data = bytes((await reading)["data"])[:expected]
            except ApplicationError as exc:
                log.warning(
                    "download of %r from session %s stopped at %d of %d bytes: %s", path, call.session_id, sent, size, exc.detail
                )
                return
            if len(data) < expected:  # the rest of the reads asked for are dropped (finally)
                if data:
                    yield data
                return
    finally:
        for _, reading in asked:
            reading.cancel()
