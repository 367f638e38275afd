"""`fgpu cp`: copy a file into a session or out of it, as scp does (`fgpu cp LOCAL SESSION:PATH`,
`fgpu cp SESSION:PATH LOCAL`), through `/api/v1/sessions/<id>/files/content/`. The file streams
both ways (never whole in memory); a download is written to a temporary file beside its target
and renamed once complete, so a failed copy leaves no partial file.

PATH is relative to the session's home (`~/` at its start is taken off; `data/…` is your
persistent folder); empty or ending in `/`, or naming a folder, it gets the local file's name."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.parse

from fgpu_cli.client import ApiError, Client

CHUNK = 256 * 1024


class CopyError(Exception):
    """A copy that cannot be done as asked (exit 1)."""


def split_remote(arg: str) -> tuple[str, str] | None:
    """`SESSION:PATH` → (SESSION, PATH); None for a local path (no `:`, or a `/` before it: use
    `./a:b` for a local file whose name holds a colon)."""
    session, colon, path = arg.partition(":")
    if not colon or not session or "/" in session:
        return None
    return session, path[2:] if path.startswith("~/") else ("" if path == "~" else path)


def _url(session_id: str, tail: str) -> str:
    return f"/api/v1/sessions/{session_id}/files/{tail}"


def _is_remote_dir(client: Client, session_id: str, path: str) -> bool:
    try:
        client.get(_url(session_id, ""), query={"path": path})
        return True
    except ApiError as exc:
        if exc.status in (400, 404) and (exc.body or {}).get("type") in ("not-found", "not-a-directory"):
            return False
        raise


def upload(client: Client, session_id: str, local: str, remote: str) -> dict:
    """Send the file `local` to `remote` in the session; the new entry (`{"name", "size", …}`)."""
    if not os.path.isfile(local):
        raise CopyError(f"{local}: no such file (fgpu cp copies files, not folders)")
    name = os.path.basename(local)
    if not remote or remote.endswith("/") or _is_remote_dir(client, session_id, remote):
        remote = remote.rstrip("/") + "/" + name if remote.strip("/") else name
    size = os.path.getsize(local)
    with open(local, "rb") as body:
        with client.open(
            "PUT",
            _url(session_id, "content/"),
            query={"path": remote},
            data=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
        ) as answer:
            return json.loads(client.guarded(answer.read))


def download(client: Client, session_id: str, remote: str, local: str) -> int:
    """Write the session's file `remote` to `local` (a folder: the file keeps its name; `-`:
    stdout). Returns the bytes written."""
    query = {"path": remote}
    with client.open(
        "GET", _url(session_id, "content/"), query=query, headers={"Accept": "application/octet-stream, application/json"}
    ) as answer:
        if local == "-":
            return _copy(client, answer, sys.stdout.buffer)
        if os.path.isdir(local):
            local = os.path.join(
                local, _filename(answer.headers.get("Content-Disposition", "")) or os.path.basename(remote.rstrip("/"))
            )
        folder = os.path.dirname(os.path.abspath(local))
        fd, temp = tempfile.mkstemp(prefix=".fgpu-cp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                written = _copy(client, answer, out)
            expected = answer.headers.get("Content-Length")
            if expected is not None and int(expected) != written:
                raise CopyError(f"the download stopped after {written} of {expected} bytes; nothing was written")
            os.replace(temp, local)
            return written
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise


def _copy(client: Client, answer, out) -> int:
    written = 0
    while True:
        chunk = client.guarded(answer.read, CHUNK)
        if not chunk:
            return written
        out.write(chunk)
        written += len(chunk)


def _filename(disposition: str) -> str:
    """The file name of a Content-Disposition header (`filename*=utf-8''…` or `filename="…"`),
    reduced to its last part ("" for none, or `.` / `..`)."""
    for part in disposition.split(";"):
        key, _, value = part.strip().partition("=")
        if key.lower() == "filename*" and "''" in value:
            name = os.path.basename(urllib.parse.unquote(value.split("''", 1)[1]))
        elif key.lower() == "filename":
            name = os.path.basename(value.strip('"'))
        else:
            continue
        return "" if name in (".", "..") else name
    return ""
