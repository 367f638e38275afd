"""A session's files (issue 18, item 6): the rules for a path both sides apply, and the shapes of
the messages between the web and the session's agent.

A path names a file under one of a session's two roots, always relative, `/`-separated:

- the session's **home** (its working directory: `/home/work` in a container, the agent's
  `scratch-root/<session id>` with the process runtime), and
- the owner's **persistent folder**, which the session sees as `~/data` (DATA_DIR): a directory
  per user under the agent's `[container] data-root` that outlives sessions (Backend.AI's
  vfolders); a path whose first part is `data` is resolved in it; and
- each of the owner's **projects' folders**, `projects/<project name>`, one per project under
  `<data-root>/projects/<project id>`, shared by its members; and
- each folder **shared** with the owner (issue 36.5: a user's persistent folder or a project's,
  sessions.serving.shares), `shared/<name>`, read-only unless the share says read-write.

`path_parts` refuses what could leave a root or confuse a terminal before anything is opened:
absolute paths, `.` and `..` parts, NUL and control characters (C0, DEL, C1), unpaired
surrogates, parts over NAME_MAX_BYTES and paths over PATH_MAX_CHARS. The agent then opens every
part relative to the root's descriptor with O_NOFOLLOW (agent.files), so a symbolic link on the
way is refused too, wherever it points.

Messages (channel layer, the session's `pty.<node>.<id>` group, answered on `reply_channel`):
`pty.files` {op, owner_id, projects ({name: id}: the owner's), shared ({name: {kind: "user" |
"project", id, read_only}}: the folders shared with the owner now; absent from an older web), path, …} →
`files.result` {ok: true, …} or {ok: false, error, detail}.
`op`: `list` {path} → {entries: [{name, type, size, mtime}], truncated}; `stat` {path} →
{entry}; `read` {path, offset, length ≤ CHUNK_BYTES} → {data (bytes), size, eof};
`upload_begin` {path, size (or None), cap} → {upload_id}; `upload_chunk` {upload_id, offset,
data (≤ CHUNK_BYTES)} → {written}; `upload_commit` {upload_id} → {entry}; `upload_abort`
{upload_id}; `delete` {path} → {}; `mkdir` {path} → {entry}. `error` is one of ERRORS.

A transfer's bytes in bulk go over one connection to the agent's listener (agent.direct, a
one-time token), or, where the web that asked runs on the agent's own event loop (standalone:
uvicorn's loop serves both), in this process: the agent offers the transfer under the same token
here (`offer_local`), the web takes it (`take_local`) and the bytes pass as Python objects, with
no socket between the two and the same checks (the agent's transfer runs them).
"""

from __future__ import annotations

import asyncio
import unicodedata
from typing import Any

CHUNK_BYTES = 256 * 1024  # the most file bytes one message carries (well under the layers' limits)
PATH_MAX_CHARS = 4096
NAME_MAX_BYTES = 255  # one part, in UTF-8 bytes (Linux's NAME_MAX)
DATA_DIR = "data"  # where a session sees its owner's persistent folder, under its home
PROJECTS_DIR = "projects"  # where it sees each of its owner's projects' folders: projects/<name>
SHARED_DIR = "shared"  # where it sees the folders shared with its owner: shared/<name> (issue 36.5)
META_DIR = ".fgpu"  # the agent's own files in a home (the virtual nvidia-smi): read-only to the file API
LIST_MAX_ENTRIES = 5000  # a listing says `truncated` past this many entries

FILES = "pty.files"
RESULT = "files.result"

# error → HTTP status the web answers with
ERRORS = {
    "bad-path": 400,
    "symlink": 400,
    "not-found": 404,
    "not-a-directory": 400,
    "is-a-directory": 400,
    "not-a-file": 400,
    "exists": 409,
    "read-only": 403,
    "over-cap": 413,
    "no-data-folder": 404,
    "upload-gone": 409,
    "failed": 502,
}


LOCAL_TTL_S = 5.0  # how long a transfer offered in this process may be taken (agent.direct's TOKEN_TTL_S)
_local: dict[str, tuple[asyncio.AbstractEventLoop, Any, float]] = {}  # token → (the offering loop, transfer, expiry)


class TransferRefused(Exception):
    """The agent refused a transfer taken in this process: `error` one of ERRORS, `detail` a sentence."""

    def __init__(self, error: str, detail: str) -> None:
        super().__init__(detail)
        self.error = error
        self.detail = detail


def offer_local(token: str, transfer: Any) -> None:
    """Offer `transfer` (the agent's: what the web calls to move the bytes) under `token` to a web
    on the running event loop, for LOCAL_TTL_S seconds, once."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    for old, (_, _, expiry) in list(_local.items()):  # a copy: agents on other threads' loops offer too
        if expiry < now:
            _local.pop(old, None)
    _local[token] = (loop, transfer, now + LOCAL_TTL_S)


def take_local(token: object) -> Any:
    """The transfer offered under `token` (a string) on the running event loop, taken now (it can
    be taken once), or None: no such offer, expired, or offered on another loop (an agent in
    another thread: the caller connects to its listener)."""
    if not isinstance(token, str):
        return None
    entry = _local.get(token)
    loop = asyncio.get_running_loop()
    if entry is None or entry[0] is not loop:
        return None
    _local.pop(token, None)
    return entry[1] if entry[2] >= loop.time() else None


class PathRefused(ValueError):
    """A path the file API refuses before opening anything; the message says why."""


def path_parts(path: str) -> list[str]:
    """The parts of `path` (relative, `/`-separated; "" or "/"-free empty parts collapse: `a//b/`
    is `["a", "b"]`, "" the root). Raises PathRefused for an absolute path, a `.` or `..` part, a
    NUL or other control character (C0, DEL, C1), an unpaired surrogate, a part longer than
    NAME_MAX_BYTES bytes or a path longer than PATH_MAX_CHARS characters."""
    if not isinstance(path, str):
        raise PathRefused("the path is not text")
    if len(path) > PATH_MAX_CHARS:
        raise PathRefused(f"the path is longer than {PATH_MAX_CHARS} characters")
    if "\x00" in path:
        raise PathRefused("the path holds a NUL character")
    for ch in path:
        if unicodedata.category(ch) == "Cc":
            raise PathRefused(f"the path holds a control character (U+{ord(ch):04X})")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise PathRefused("the path holds an unpaired surrogate") from None
    if path.startswith("/"):
        raise PathRefused(
            f"absolute paths are refused: give a path relative to the session's home (its persistent folder is {DATA_DIR}/)"
        )
    parts = [part for part in path.split("/") if part]
    for part in parts:
        if part in (".", ".."):
            raise PathRefused(f"'{part}' is refused in a path: paths stay inside the session's home")
        if len(part.encode("utf-8")) > NAME_MAX_BYTES:
            raise PathRefused(f"a part of the path is longer than {NAME_MAX_BYTES} bytes")
    return parts
