"""The agent's side of a session's files (issue 18, item 6): list, read, upload, delete and make
folders in a session's home and in its owner's persistent folder, confined to them.

Confinement is enforced here, on the node, whatever the web checked: the path's parts are
checked by protocol.files.path_parts (no absolute paths, no `.` or `..`, no NUL or control
characters), then every part is opened relative to the root's directory descriptor with
O_NOFOLLOW (`openat`-style), so a symbolic link anywhere on the way is refused, not followed,
wherever it points; files are opened with O_NOFOLLOW | O_NONBLOCK and must be regular files
(never a FIFO or a device). A delete of a symbolic link removes the link itself. An upload goes
to a temporary file (`.fgpu-upload-<id>`) in the target's folder, created with O_EXCL, and is
renamed over the target (relative to the same descriptor) once complete; past the owner's cap
(`cap` bytes in the folder: what the root holds, measured without following links, plus the
upload) it is refused at its start when its size is known, else at the chunk that crosses it,
and its temporary file removed.

The persistent folder: `<data-root>/users/<owner id>` (agent.toml `[container] data-root`; on a
cluster of several nodes, storage every node mounts at the same path, e.g. NFS). `link_data`
makes it and shows it in a new session's home as `data`: a symbolic link with the process
runtime, a bind mount with the docker runtime (the runtime mounts `spec["data_dir"]`). The file
API never follows that link: a path starting `data/` is resolved from the folder itself, which
the agent finds from the owner's id the web sends, not from anything in the session's home.

Messages: see protocol.files. Blocking work runs on a small pool of its own (FILE_THREADS).

Bytes in bulk (a `read` or `upload_begin` asking `direct`): the answer carries a one-time offer
(`direct`: {host, port, token}, agent.direct's listener: the agent's direct-stream one where it
listens, else one of its own on `app-address`, where session apps listen and the web reaches
them) and the bytes go over that one connection: a download with sendfile (the kernel copies
the page cache to the socket), an upload moved from the socket to its temporary file with splice
in a thread of the transfer's own (FileOps.upload_from_socket: the bytes never enter Python and
the loop does nothing per piece), with the same confinement, cap and size checks. No round trip
per chunk. An upload's writeback starts every WRITE_BACK_BYTES as it is written (sync_file_range),
so the commit's fsync, which its 201 waits for, writes the tail only. Without a listener the answer is the
chunked one, and the web reads over the channel layer as before. The same transfer is offered
under the same token in this process too (protocol.files.offer_local), for a web on this agent's
event loop (standalone), which then takes the bytes as Python objects with no socket between:
the file read with pread, an upload's pieces written on the files pool while the next arrive, those
that arrived meanwhile in one writev. Either way a
transfer is served once (`_Offered`).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import select
import shutil
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from agent.direct import DirectServer
from protocol import files as proto
from protocol.terminal_stream import DIRECT_OK, DIRECT_REFUSED, encode

log = logging.getLogger(__name__)

FILE_THREADS = 4
UPLOAD_IDLE_S = 600  # an upload untouched this long is abandoned (its temporary file removed)
UPLOAD_PREFIX = ".fgpu-upload-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
STREAM_READ_BYTES = 1024 * 1024  # what a direct upload asks its socket for at a time (and its pipe holds: splice)
UPLOAD_HOLD_BYTES = 4 * 1024 * 1024  # an upload taken in this process: bytes received while a write is in flight, at most
WRITE_BACK_BYTES = 8 * 1024 * 1024  # an upload's written bytes handed to the disk's writeback this many at a time
POLL_S = 1.0  # how often a direct upload's thread, waiting for bytes, looks whether it should stop


def _in_thread(fn: Callable[..., Any], *args) -> asyncio.Future:
    """`fn(*args)` run in a new thread (a transfer's: long, so not on a pool a short op waits for),
    as a future of the running loop (cancelling it does not stop the thread)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as raised:  # noqa: BLE001 - handed to the loop's future
            result, exc = None, raised
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop closed meanwhile (the agent stopped)

    threading.Thread(target=run, name="agent-files-transfer", daemon=True).start()
    return future


class FileError(Exception):
    """A refusal: `code` one of protocol.files.ERRORS, `detail` a sentence."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def data_folder(data_root: Path | None, owner_id) -> Path | None:
    """The persistent folder of user `owner_id` (an integer id) under `data_root`, or None
    (no data root configured, or no owner id)."""
    if data_root is None or owner_id is None or isinstance(owner_id, bool):
        return None
    try:
        owner = int(owner_id)
    except (TypeError, ValueError):
        return None
    return Path(data_root) / "users" / str(owner) if owner > 0 else None


def project_folders(data_root: Path | None, projects) -> dict[str, Path]:
    """name → the persistent folder of each project in `projects` (`[{"id", "name"}]`, or
    `{name: id}`): `<data_root>/projects/<project id>`. A name that is not one path part (or
    an id that is not one) is left out."""
    if data_root is None or not projects:
        return {}
    pairs = projects.items() if isinstance(projects, dict) else ((p.get("name"), p.get("id")) for p in projects)
    found = {}
    for name, project_id in pairs:
        try:
            if proto.path_parts(str(name)) == [name] and proto.path_parts(str(project_id)) == [str(project_id)]:
                found[name] = Path(data_root) / "projects" / str(project_id)
        except proto.PathRefused:
            continue
    return found


def shared_folders(data_root: Path | None, shared) -> dict[str, tuple[Path, bool]]:
    """name → (folder, read-only) of each folder in `shared` (the start spec's, or the file
    API's: `[{"name", "kind": "user" | "project", "id", "read_only"}]` or {name: {…}}): a user's
    `<data_root>/users/<id>` or a project's `<data_root>/projects/<id>`. A name or id that is not
    one path part, or an unknown kind, is left out; `read_only` is True unless it is False."""
    if data_root is None or not shared:
        return {}
    items = [{**v, "name": k} for k, v in shared.items()] if isinstance(shared, dict) else list(shared)
    found: dict[str, tuple[Path, bool]] = {}
    for item in items:
        if not isinstance(item, dict):
            continue
        name, kind, folder_id = str(item.get("name", "")), item.get("kind"), str(item.get("id", ""))
        try:
            if proto.path_parts(name) != [name] or proto.path_parts(folder_id) != [folder_id]:
                continue
        except proto.PathRefused:
            continue
        if kind == "user":
            folder = data_folder(data_root, folder_id if folder_id.isdigit() else None)
        elif kind == "project":
            folder = Path(data_root) / "projects" / folder_id
        else:
            continue
        if folder is not None:
            found[name] = (folder, item.get("read_only") is not False)
    return found


def _show(folder: Path, target: Path, *, link: bool) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not link:
        target.mkdir(exist_ok=True)
        return
    try:
        target.symlink_to(folder, target_is_directory=True)
    except FileExistsError:
        pass


def link_data(
    *,
    work_dir: Path,
    folder: Path | None,
    link: bool,
    projects: dict[str, Path] | None = None,
    shared: dict[str, tuple[Path, bool]] | None = None,
) -> None:
    """Make the owner's persistent `folder` (mode 0700) and show it in the session's home
    `work_dir` as `data`, each of `projects` (name → folder) as `projects/<name>` and each of
    `shared` (name → (folder, read-only)) as `shared/<name>`: a
    symbolic link to it (`link`: the process runtime), or an empty directory the runtime
    bind-mounts it on (the docker runtime). An existing entry that is not such a link (a
    working directory kept from before) is left as it is."""
    if folder is not None:
        _show(folder, work_dir / proto.DATA_DIR, link=link)
    if projects:
        (work_dir / proto.PROJECTS_DIR).mkdir(exist_ok=True)
        for name, project_folder in projects.items():
            _show(project_folder, work_dir / proto.PROJECTS_DIR / name, link=link)
    if shared:
        (work_dir / proto.SHARED_DIR).mkdir(exist_ok=True)
        for name, (shared_folder, _) in shared.items():
            _show(shared_folder, work_dir / proto.SHARED_DIR / name, link=link)


def _give(parent_fd: int, name: str) -> None:
    """What the file API makes belongs to whoever owns the folder it is made in (the session's
    user: the uid of a container's sessions), where the agent may give it (runs as root)."""
    if os.geteuid() == 0:
        st = os.fstat(parent_fd)
        os.chown(name, st.st_uid, st.st_gid, dir_fd=parent_fd, follow_symlinks=False)


def _entry(name: str, st: os.stat_result) -> dict:
    mode = st.st_mode
    kind = "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "link" if stat.S_ISLNK(mode) else "other"
    return {"name": name, "type": kind, "size": st.st_size if kind == "file" else 0, "mtime": int(st.st_mtime)}


def _oserror(exc: OSError, name: str) -> FileError:
    if exc.errno == errno.ELOOP:
        return FileError("symlink", f"'{name}' is a symbolic link; the file API does not follow links")
    if exc.errno == errno.ENOENT:
        return FileError("not-found", f"'{name}' does not exist")
    if exc.errno == errno.ENOTDIR:
        return FileError("not-a-directory", f"'{name}' is not a folder")
    if exc.errno == errno.EISDIR:
        return FileError("is-a-directory", f"'{name}' is a folder")
    if exc.errno == errno.EEXIST:
        return FileError("exists", f"'{name}' exists")
    return FileError("failed", f"'{name}': {exc.strerror}")


@dataclass
class Upload:
    root: str  # "home" or "data": which cap it counts against
    dir_fd: int
    temp: str
    name: str
    fd: int
    room: int  # bytes the cap leaves for it
    size: int | None
    written: int = 0
    touched: float = field(default_factory=time.monotonic)
    busy: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # held while fd is in use
    flushed: int = 0  # bytes from the start handed to writeback (_write_back)


def _sync_file_range() -> Callable[..., int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


SYNC_FILE_RANGE = _sync_file_range()  # Linux's sync_file_range(2), where the C library has it
SYNC_FILE_RANGE_WRITE = 2


def _write_back(upload: Upload) -> None:
    """Start the disk's writeback of what the upload wrote since the last call, once WRITE_BACK_BYTES
    wait (sync_file_range SYNC_FILE_RANGE_WRITE: it does not wait for the disk): the fsync of the
    commit, which the 201 waits for, then writes only the tail, as the transfer's bytes went to the
    disk beside it. Caller holds `upload.busy`."""
    if SYNC_FILE_RANGE is not None and upload.written - upload.flushed >= WRITE_BACK_BYTES:
        SYNC_FILE_RANGE(upload.fd, upload.flushed, upload.written - upload.flushed, SYNC_FILE_RANGE_WRITE)
        upload.flushed = upload.written


def _write_all(fd: int, pieces: Sequence[bytes]) -> None:
    """Write `pieces` (bytes-like, in order) to `fd`: one writev, again for what a short write left."""
    views = [memoryview(piece) for piece in pieces if len(piece)]
    while views:
        done = os.writev(fd, views[:1024])  # IOV_MAX
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if done:
            views[0] = views[0][done:]


def _from_pipe(pipe: int, fd: int, count: int) -> None:
    """Move `count` bytes waiting in `pipe` to the file `fd`: splice (no copy through user space),
    or read and write where the file system does not splice (EINVAL)."""
    while count > 0:
        try:
            moved = os.splice(pipe, fd, count, flags=os.SPLICE_F_MOVE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            moved = os.write(fd, os.read(pipe, count))
        count -= moved


class FileOps:
    """File operations confined to a session's `home` and its owner's persistent folder `data`
    (None: none). Blocking; every method raises FileError."""

    def __init__(
        self,
        home: Path,
        data: Path | None,
        projects: dict[str, Path] | None = None,
        shared: dict[str, tuple[Path, bool]] | None = None,
    ) -> None:
        self.home = Path(home)
        self.data = data
        self.projects = projects or {}  # name → the project's persistent folder
        self.shared = shared or {}  # name → (a folder shared with the owner, read-only): shared/<name>

    # --- resolving ---------------------------------------------------------------------

    def _root(self, path: str) -> tuple[str, int, list[str]]:
        """(root name, an open descriptor of the root, the parts under it). Caller closes it."""
        try:
            parts = proto.path_parts(path)
        except proto.PathRefused as exc:
            raise FileError("bad-path", str(exc)) from None
        if parts and parts[0] == proto.DATA_DIR and self.data is not None:
            which, base, parts = "data", self.data, parts[1:]
        elif len(parts) > 1 and parts[0] == proto.PROJECTS_DIR and parts[1] in self.projects:
            which, base, parts = f"project:{parts[1]}", self.projects[parts[1]], parts[2:]
        elif len(parts) > 1 and parts[0] == proto.SHARED_DIR and parts[1] in self.shared:
            which, base, parts = f"shared:{parts[1]}", self.shared[parts[1]][0], parts[2:]
        else:
            which, base = "home", self.home
        try:
            fd = os.open(base, _DIR_FLAGS)
        except FileNotFoundError:
            raise FileError(
                "not-found" if which == "home" else "no-data-folder",
                "the session's home is gone" if which == "home" else "the persistent folder is not there",
            ) from None
        return which, fd, parts

    @staticmethod
    def _descend(fd: int, parts: list[str], *, create: bool = False) -> int:
        """Open the folder `parts` under `fd` part by part, refusing links (O_NOFOLLOW); with
        `create`, make missing folders (0755). Returns a new descriptor; `fd` stays open."""
        current = os.dup(fd)
        try:
            for name in parts:
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=current)
                        _give(current, name)
                    except FileExistsError:
                        pass
                    except OSError as exc:
                        raise _oserror(exc, name) from None
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=current)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        try:
                            if stat.S_ISLNK(os.stat(name, dir_fd=current, follow_symlinks=False).st_mode):
                                raise FileError(
                                    "symlink", f"'{name}' is a symbolic link; the file API does not follow links"
                                ) from None
                        except FileNotFoundError:
                            pass
                    raise _oserror(exc, name) from None
                os.close(current)
                current = nxt
            return current
        except BaseException:
            os.close(current)
            raise

    def _parent(self, path: str, *, write: bool, create: bool = False) -> tuple[str, int, str]:
        """(root name, descriptor of the parent folder, the last part) of a path naming an
        entry (not a root). `write`: refuse the agent's own `.fgpu` folder."""
        which, root, parts = self._root(path)
        try:
            if not parts:
                raise FileError(
                    "bad-path", "the path names a folder the file API does not change (the home or the persistent folder itself)"
                )
            if write and which.startswith("shared:") and self.shared[which[7:]][1]:
                raise FileError("read-only", f"{proto.SHARED_DIR}/{which[7:]} is shared with you read-only")
            if write and which == "home" and parts[0] == proto.SHARED_DIR:
                raise FileError("not-found", f"{proto.SHARED_DIR}/ holds the folders shared with you; there is no such one")
            if write and which == "home" and parts[0] == proto.META_DIR:
                raise FileError(
                    "read-only", f"{proto.META_DIR}/ holds the console's own files (the virtual nvidia-smi); it is read-only here"
                )
            if parts[-1].startswith(UPLOAD_PREFIX):
                raise FileError("bad-path", f"names starting '{UPLOAD_PREFIX}' are the file API's own")
            return which, self._descend(root, parts[:-1], create=create), parts[-1]
        finally:
            os.close(root)

    # --- operations --------------------------------------------------------------------

    def list(self, path: str) -> dict:
        """The folder's entries, the persistent folder first, then folders, then by name:
        `{"path", "entries": [{"name", "type": "dir" | "file" | "link" | "other", "size" (bytes),
        "mtime" (epoch s)}], "truncated"}`. In the home, `data` (the persistent folder) is listed as a folder with
        `"persistent": true`; the file API's temporary upload files are left out."""
        which, root, parts = self._root(path)
        if which == "home" and parts == [proto.SHARED_DIR]:
            os.close(root)
            return {
                "path": proto.SHARED_DIR,
                "truncated": False,
                "entries": [
                    {
                        "name": name,
                        "type": "dir",
                        "size": 0,
                        "mtime": int(folder.stat().st_mtime),
                        "persistent": True,
                        "read_only": read_only,
                    }
                    for name, (folder, read_only) in sorted(self.shared.items())
                    if folder.is_dir()
                ],  # fmt: skip
            }
        if which == "home" and parts == [proto.PROJECTS_DIR] and self.projects:
            os.close(root)
            return {
                "path": proto.PROJECTS_DIR,
                "truncated": False,
                "entries": [
                    {"name": name, "type": "dir", "size": 0, "mtime": int(folder.stat().st_mtime), "persistent": True}
                    for name, folder in sorted(self.projects.items())
                    if folder.is_dir()
                ],
            }
        try:
            fd = self._descend(root, parts)
        finally:
            os.close(root)
        entries: list[dict] = []
        truncated = False
        try:
            with os.scandir(fd) as it:
                for item in it:
                    if item.name.startswith(UPLOAD_PREFIX):
                        continue
                    if len(entries) >= proto.LIST_MAX_ENTRIES:
                        truncated = True
                        break
                    try:
                        entry = _entry(item.name, item.stat(follow_symlinks=False))
                    except OSError:
                        continue
                    if which == "home" and not parts and item.name == proto.DATA_DIR and self.data is not None:
                        entry.update(type="dir", size=0, persistent=True)
                    elif which == "home" and not parts and item.name == proto.PROJECTS_DIR and self.projects:
                        entry.update(type="dir", size=0)
                    elif which == "home" and not parts and item.name == proto.SHARED_DIR:
                        entry.update(type="dir", size=0)
                    entries.append(entry)
        finally:
            os.close(fd)
        entries.sort(key=lambda e: (not e.get("persistent"), e["type"] != "dir", e["name"]))
        prefix = (
            [proto.DATA_DIR]
            if which == "data"
            else [proto.PROJECTS_DIR, which[8:]]
            if which.startswith("project:")
            else [proto.SHARED_DIR, which[7:]]
            if which.startswith("shared:")
            else []
        )
        return {"path": "/".join(prefix + parts), "entries": entries, "truncated": truncated}

    def stat(self, path: str) -> dict:
        """`{"entry": {...}}` as `list` gives it; a link is described, not followed."""
        which, root, parts = self._root(path)
        try:
            if not parts:
                return {"entry": {"name": "", "type": "dir", "size": 0, "mtime": int(os.fstat(root).st_mtime)}}
            fd = self._descend(root, parts[:-1])
        finally:
            os.close(root)
        try:
            return {"entry": _entry(parts[-1], os.stat(parts[-1], dir_fd=fd, follow_symlinks=False))}
        except OSError as exc:
            raise _oserror(exc, parts[-1]) from None
        finally:
            os.close(fd)

    def read(self, path: str, offset: int, length: int) -> dict:
        """Up to `length` (≤ CHUNK_BYTES) bytes of a regular file from `offset`: `{"data",
        "size" (the file's size now), "eof"}`. A link, folder, FIFO or device is refused."""
        length = max(0, min(int(length), proto.CHUNK_BYTES))
        offset = max(0, int(offset))
        fd, st = self.open_file(path)
        try:
            data = os.pread(fd, length, offset)
            return {"data": data, "size": st.st_size, "eof": offset + len(data) >= st.st_size}
        finally:
            os.close(fd)

    def open_file(self, path: str) -> tuple[int, os.stat_result]:
        """(an open descriptor, its stat) of the regular file at `path`, for reading; the caller
        closes it. A link, folder, FIFO or device is refused (FileError)."""
        _, parent, name = self._parent(path, write=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            raise _oserror(exc, name) from None
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise FileError("is-a-directory", f"'{name}' is a folder")
            if not stat.S_ISREG(st.st_mode):
                raise FileError("not-a-file", f"'{name}' is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def delete(self, path: str) -> dict:
        """Remove a file, a link (the link itself) or a folder with all it holds (without
        following links: shutil.rmtree on descriptors)."""
        _, parent, name = self._parent(path, write=True)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)
            return {}
        except OSError as exc:
            raise _oserror(exc, name) from None
        finally:
            os.close(parent)

    def mkdir(self, path: str) -> dict:
        """Make the folder (and its missing parents)."""
        _, parent, name = self._parent(path, write=True, create=True)
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
                _give(parent, name)
            except FileExistsError:
                if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise FileError("exists", f"'{name}' exists and is not a folder") from None
            return {"entry": _entry(name, os.stat(name, dir_fd=parent, follow_symlinks=False))}
        except OSError as exc:
            raise _oserror(exc, name) from None
        finally:
            os.close(parent)

    def usage(self, which: str) -> int:
        """Bytes of the regular files under a root ("home": without the persistent folders;
        "data"; "project:<name>"), links not followed."""
        base = (
            self.data
            if which == "data"
            else self.projects[which[8:]]
            if which.startswith("project:")
            else self.shared[which[7:]][0]
            if which.startswith("shared:")
            else self.home
        )
        if base is None:  # "data" of a session whose owner has no persistent folder
            raise FileError("not-found", "there is no persistent folder")
        total = 0
        fd = os.open(base, _DIR_FLAGS)
        try:
            for _, _, names, dir_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
        finally:
            os.close(fd)
        return total

    def upload_begin(self, path: str, size: int | None, cap: int) -> Upload:
        """Open the temporary file of an upload to `path` (parents made as needed). Refused
        (over-cap) when `size` does not fit in what `cap` leaves of the root; an existing folder
        at `path` is refused (is-a-directory)."""
        which, parent, name = self._parent(path, write=True, create=True)
        try:
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise FileError("is-a-directory", f"'{name}' is a folder")
            except FileNotFoundError:
                pass
            room = int(cap) - self.usage(which)
            if size is not None and int(size) > room:
                where = (
                    "your persistent folder"
                    if which == "data"
                    else f"project {which[8:]}'s folder"
                    if which.startswith("project:")
                    else f"the shared folder {which[7:]}"
                    if which.startswith("shared:")
                    else "this session's home"
                )
                raise FileError(
                    "over-cap",
                    f"the file ({int(size)} bytes) does not fit: {where} may hold {int(cap)} bytes and has {max(0, room)} left",
                )
            temp = UPLOAD_PREFIX + secrets.token_hex(8)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=parent)
            _give(parent, temp)
        except BaseException:
            os.close(parent)
            raise
        return Upload(root=which, dir_fd=parent, temp=temp, name=name, fd=fd, room=room, size=None if size is None else int(size))

    @staticmethod
    def upload_chunk(upload: Upload, offset: int, data: bytes) -> dict:
        if offset != upload.written:
            raise FileError("bad-path", f"chunk at {offset}, expected {upload.written}")
        return FileOps.upload_pieces(upload, [data])

    @staticmethod
    def _allowed(upload: Upload) -> int:
        """The bytes the upload may hold in all: what the cap leaves, and no more than its declared size."""
        return upload.room if upload.size is None else min(upload.room, upload.size)

    @staticmethod
    def _over_cap() -> FileError:
        return FileError("over-cap", "the upload is larger than its declared size or than the cap leaves room for")

    @staticmethod
    def upload_pieces(upload: Upload, pieces: Sequence[bytes]) -> dict:
        """Append `pieces` (bytes-like, in order) to the upload's temporary file with one writev:
        `{"written"}` (bytes in all). Raises FileError over-cap (nothing written) where they pass the
        declared size or the cap's room, upload-gone where the upload was closed; OSError."""
        count = sum(len(piece) for piece in pieces)
        if upload.written + count > FileOps._allowed(upload):
            raise FileOps._over_cap()
        with upload.busy:
            if upload.fd < 0:
                raise FileError("upload-gone", "the upload ended")
            _write_all(upload.fd, pieces)
            upload.written += count
            upload.touched = time.monotonic()
            _write_back(upload)
        return {"written": upload.written}

    @staticmethod
    def upload_from_socket(upload: Upload, sock: int, held: bytes, stop: threading.Event) -> int:
        """Blocking (a thread of its own): write `held` (what was received already), then what the
        socket `sock` (non-blocking; closed here) gives until its end, to the upload's temporary
        file, socket to pipe to file with splice (the bytes never enter user space); the bytes
        written in all. Checks as upload_pieces: past the declared size or the cap's room, FileError
        over-cap (the bytes that crossed it not written); a file error, FileError failed. Raises
        ConnectionError where the socket fails, gives nothing for UPLOAD_IDLE_S or `stop` is set."""
        pipe_r = pipe_w = -1
        try:
            if held:
                FileOps.upload_pieces(upload, [held])
            pipe_r, pipe_w = os.pipe2(os.O_CLOEXEC)
            try:
                fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, STREAM_READ_BYTES)
            except OSError:
                pass  # the system's pipe-max-size is lower: the default pipe (64 KiB) does, in more moves
            waiting = select.poll()
            waiting.register(sock, select.POLLIN)
            allowed, idle = FileOps._allowed(upload), 0.0
            with upload.busy:
                while True:
                    if stop.is_set():
                        raise ConnectionError("the agent stopped the transfer")
                    try:
                        # one byte more than allowed, to tell a body that passes it from one that ends there
                        count = os.splice(
                            sock, pipe_w, min(STREAM_READ_BYTES, allowed - upload.written + 1), flags=os.SPLICE_F_NONBLOCK
                        )
                    except BlockingIOError:
                        if waiting.poll(POLL_S * 1000):
                            continue
                        idle += POLL_S
                        if idle >= UPLOAD_IDLE_S:
                            raise ConnectionError(f"no bytes for {UPLOAD_IDLE_S} s") from None
                        continue
                    except OSError as exc:
                        raise ConnectionError(exc.strerror or str(exc)) from None
                    if not count:
                        return upload.written
                    if upload.written + count > allowed:
                        raise FileOps._over_cap()
                    if upload.fd < 0:
                        raise FileError("upload-gone", "the upload ended")
                    try:
                        _from_pipe(pipe_r, upload.fd, count)
                    except OSError as exc:
                        raise FileError("failed", exc.strerror or str(exc)) from None
                    upload.written += count
                    upload.touched, idle = time.monotonic(), 0.0
                    _write_back(upload)
        finally:
            for fd in (pipe_r, pipe_w, sock):
                if fd >= 0:
                    os.close(fd)

    @staticmethod
    def upload_commit(upload: Upload) -> dict:
        if upload.size is not None and upload.written != upload.size:
            raise FileError("bad-path", f"the upload ended after {upload.written} of its {upload.size} bytes")
        with upload.busy:
            if upload.fd < 0:
                raise FileError("upload-gone", "the upload ended")
            os.fsync(upload.fd)
            os.close(upload.fd)
            upload.fd = -1
        try:
            os.rename(upload.temp, upload.name, src_dir_fd=upload.dir_fd, dst_dir_fd=upload.dir_fd)
            return {"entry": _entry(upload.name, os.stat(upload.name, dir_fd=upload.dir_fd, follow_symlinks=False))}
        except OSError as exc:
            raise _oserror(exc, upload.name) from None

    @staticmethod
    def upload_close(upload: Upload, *, remove: bool) -> None:
        with upload.busy:  # a direct upload's thread writing to it ends first
            if upload.fd >= 0:
                os.close(upload.fd)
                upload.fd = -1
        if remove:
            try:
                os.unlink(upload.temp, dir_fd=upload.dir_fd)
            except OSError:
                pass
        if upload.dir_fd >= 0:
            os.close(upload.dir_fd)
            upload.dir_fd = -1


class _Offered:
    """One transfer offered both over the listener (`tcp`, agent.direct.offer_stream) and in this
    process (`local`, protocol.files.offer_local) under one token, served by whichever is taken
    first; the other is then refused."""

    def __init__(self, serve: Callable[..., Awaitable[None]], local: Callable[..., Any]) -> None:
        self.serve, self.local = serve, local
        self.taken = False

    async def tcp(self, reader, writer) -> None:
        if self.taken:
            writer.write(encode({"type": DIRECT_REFUSED, "error": "upload-gone", "detail": "the transfer was already taken"}))
            return
        self.taken = True
        await self.serve(reader, writer)

    def in_process(self, *args):
        if self.taken:
            raise proto.TransferRefused("upload-gone", "the transfer was already taken")
        self.taken = True
        return self.local(*args)


class SessionFiles:
    """The agent's handler of `pty.files` messages. `agent`: the Agent (its loop, channel layer,
    `data_root`)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix=f"agent-{agent.node}-files")
        self.uploads: dict[str, tuple[str, Upload]] = {}  # upload id → (session id, upload)
        self.lock = threading.Lock()
        self.own: DirectServer | None = None  # the listener for bytes where the agent has no direct one
        self._listening: asyncio.Future | None = None

    async def listener(self) -> DirectServer | None:
        """Where a transfer's bytes go directly (agent.direct): the agent's direct-stream listener
        where it serves, else one of this handler's own on the agent's `app_address` (any free
        port), started at the first transfer; None where neither listens (the bytes then go
        through the channel layer)."""
        direct = getattr(self.agent, "direct", None)
        if direct is not None and direct.serving:
            return direct
        if self._listening is None:
            self.own = DirectServer(self.agent, host=getattr(self.agent, "app_address", "127.0.0.1"), what="file transfers")
            self._listening = asyncio.ensure_future(self.own.start())
        await asyncio.shield(self._listening)
        return self.own if self.own is not None and self.own.serving else None

    def close(self) -> None:
        """Stop listening for transfers (the agent stops)."""
        if self.own is not None:
            self.own.close()

    def ops(self, running, owner_id, projects=None, shared=None) -> FileOps:
        """The session's files: its home, the owner's folder, the folders of `projects`
        ({name: id}: the owner's projects now, as the web read them) and of `shared` ({name:
        {kind, id, read_only}}: the folders shared with the owner now, as the web read them:
        a revoked share is gone from the file API at once, whatever the session mounted)."""
        data_root = getattr(self.agent, "data_root", None)
        data = data_folder(data_root, owner_id)
        return FileOps(
            running.work_dir,
            data if data is not None and data.is_dir() else None,
            project_folders(data_root, projects),
            shared_folders(data_root, shared),
        )

    def handle(self, running, message: dict) -> None:
        """Run the message's op on the file pool and answer on its reply channel."""
        self.agent._in_background(self._answer(running, message))

    async def _answer(self, running, message: dict) -> None:
        try:
            wants = message.get("direct") is True and message.get("op") in ("read", "upload_begin")
            server = await self.listener() if wants else None
            result = await self.agent._in(self.pool, self.run, running, message, direct=server is not None)
            stream = result.pop("stream", None)
            if stream is not None and server is not None:
                offered = _Offered(partial(*stream[0]), partial(*stream[1]))
                result["direct"] = server.offer_stream(offered.tcp)
                proto.offer_local(result["direct"]["token"], offered.in_process)
        except Exception as exc:  # a bug: say so rather than leave the web waiting
            log.exception("agent %s: file op %r failed", self.agent.node, message.get("op"))
            result = {"ok": False, "error": "failed", "detail": f"the agent could not do it: {exc}"}
        try:
            await self.agent.layer.send(message["reply_channel"], self.agent.guard.answer({"type": proto.RESULT, **result}))
        except Exception:
            log.exception("agent %s: could not answer a file op in session %s", self.agent.node, running.session_id)

    def run(self, running, message: dict, *, direct: bool = False) -> dict:
        """Blocking: one op (protocol.files) → its answer. `direct`: a `read` from offset 0 or an
        `upload_begin` answers with `stream`: two (function, its first arguments), one serving the
        transfer's connection (`_send`, `_receive`), one the transfer taken in this process
        (`_read_local`, `_write_upload`), for `_answer` to offer."""
        self._expire()
        op = message.get("op")
        try:
            files = self.ops(running, message.get("owner_id"), message.get("projects"), message.get("shared"))
            if op == "list":
                return {"ok": True, **files.list(message.get("path", ""))}
            if op == "stat":
                return {"ok": True, **files.stat(message.get("path", ""))}
            if op == "read" and direct and not message.get("offset"):
                fd, st = files.open_file(message["path"])
                os.close(fd)
                size, path = st.st_size, message["path"]
                stream = ((self._send, files, path, size), (self._read_local, files, path, size))
                return {"ok": True, "data": b"", "size": size, "eof": not size, "stream": stream}
            if op == "read":
                return {
                    "ok": True,
                    **files.read(message["path"], message.get("offset", 0), message.get("length", proto.CHUNK_BYTES)),
                }
            if op == "delete":
                return {"ok": True, **files.delete(message["path"])}
            if op == "mkdir":
                return {"ok": True, **files.mkdir(message["path"])}
            if op == "upload_begin":
                upload = files.upload_begin(message["path"], message.get("size"), int(message["cap"]))
                upload_id = secrets.token_hex(16)
                with self.lock:
                    self.uploads[upload_id] = (running.session_id, upload)
                if direct:
                    key = (running.session_id, upload_id)
                    return {"ok": True, "upload_id": upload_id, "stream": ((self._receive, *key), (self._write_upload, *key))}
                return {"ok": True, "upload_id": upload_id}
            if op in ("upload_chunk", "upload_commit", "upload_abort"):
                return self._upload_step(running, op, message)
            return {"ok": False, "error": "bad-path", "detail": f"unknown file op {op!r}"}
        except FileError as exc:
            return {"ok": False, "error": exc.code, "detail": exc.detail}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": "bad-path", "detail": f"malformed file message: {exc}"}
        except OSError as exc:
            return {"ok": False, "error": "failed", "detail": exc.strerror or str(exc)}

    def _upload_step(self, running, op: str, message: dict) -> dict:
        upload_id = str(message.get("upload_id", ""))
        with self.lock:
            found = self.uploads.get(upload_id)
            if found is None or found[0] != running.session_id:
                return {"ok": False, "error": "upload-gone", "detail": "no such upload (it ended or was abandoned)"}
            if op != "upload_chunk":
                del self.uploads[upload_id]
        upload = found[1]
        if op == "upload_abort":
            FileOps.upload_close(upload, remove=True)
            return {"ok": True}
        try:
            if op == "upload_chunk":
                return {"ok": True, **FileOps.upload_chunk(upload, int(message["offset"]), bytes(message["data"]))}
            result = FileOps.upload_commit(upload)
            FileOps.upload_close(upload, remove=False)
            return {"ok": True, **result}
        except BaseException:
            with self.lock:
                self.uploads.pop(upload_id, None)
            FileOps.upload_close(upload, remove=True)
            raise

    async def _send(self, files: FileOps, path: str, size: int, reader, writer) -> None:
        """A download's connection (agent.direct): the file opened again (confined as any op), a
        DIRECT_OK line, then its first `size` bytes by sendfile (fewer where it shrank since);
        a DIRECT_REFUSED line {detail} where it is gone or no longer a regular file."""
        try:
            fd, st = await self.agent._in(self.pool, files.open_file, path)
        except (FileError, OSError) as exc:
            writer.write(encode({"type": DIRECT_REFUSED, "detail": getattr(exc, "detail", str(exc))}))
            return
        with os.fdopen(fd, "rb") as source:
            writer.write(encode({"type": DIRECT_OK}))
            count = min(size, st.st_size)
            if count:
                await asyncio.get_running_loop().sendfile(writer.transport, source, 0, count)
            await writer.drain()

    async def _read_local(self, files: FileOps, path: str, size: int) -> AsyncIterator[bytes]:
        """A download taken in this process (the web on this loop): the file opened again
        (confined as any op), then its first `size` bytes (fewer where it shrank since) in pieces
        of at most STREAM_READ_BYTES, read with pread from the page cache. Raises
        protocol.files.TransferRefused where it is gone or no longer a regular file."""
        try:
            fd, st = files.open_file(path)
        except (FileError, OSError) as exc:
            raise proto.TransferRefused(getattr(exc, "code", "failed"), getattr(exc, "detail", str(exc))) from None
        try:
            offset, end = 0, min(size, st.st_size)
            while offset < end:
                data = os.pread(fd, min(STREAM_READ_BYTES, end - offset), offset)
                if not data:
                    return
                offset += len(data)
                yield data
        finally:
            os.close(fd)

    async def _receive(self, session_id: str, upload_id: str, reader, writer) -> None:
        """An upload's connection (agent.direct): the bytes the web sends until it ends its side,
        then its answer as one line. The bytes go from the socket to the temporary file in a thread
        of the transfer's own (FileOps.upload_from_socket: splice, nothing per piece on the loop),
        the loop's transport paused meanwhile; through the StreamReader (`_write_upload`) where
        splice is not there."""
        sock = writer.get_extra_info("socket")
        buffered = getattr(reader, "_buffer", None)  # what asyncio read past the token's line
        if not hasattr(os, "splice") or sock is None or not isinstance(buffered, bytearray):

            async def pieces() -> AsyncIterator[bytes]:
                while data := await reader.read(STREAM_READ_BYTES):
                    yield data

            answer = await self._write_upload(session_id, upload_id, pieces())
        else:
            writer.transport.pause_reading()
            held = bytes(buffered)
            buffered.clear()
            answer = await self._splice_upload(session_id, upload_id, os.dup(sock.fileno()), held)
        writer.write(encode(answer))
        await writer.drain()

    def _found(self, session_id: str, upload_id: str) -> Upload | None:
        with self.lock:
            found = self.uploads.get(upload_id)
        return found[1] if found is not None and found[0] == session_id else None

    def _refused(self, upload_id: str, upload: Upload, exc: FileError) -> dict:
        """The upload dropped on `exc`, and the answer saying so."""
        with self.lock:
            self.uploads.pop(upload_id, None)
        FileOps.upload_close(upload, remove=True)
        return {"type": DIRECT_REFUSED, "error": exc.code, "detail": exc.detail}

    async def _splice_upload(self, session_id: str, upload_id: str, sock: int, held: bytes) -> dict:
        """FileOps.upload_from_socket on `sock` (a descriptor it closes) in a thread of its own; the
        answer as `_write_upload`'s. Where the socket fails, or this is cancelled (the thread told
        to stop), the error goes to the caller and the upload is kept for the web's abort."""
        upload = self._found(session_id, upload_id)
        if upload is None:
            os.close(sock)
            return {"type": DIRECT_REFUSED, "error": "upload-gone", "detail": "no such upload"}
        stop = threading.Event()
        try:
            await _in_thread(FileOps.upload_from_socket, upload, sock, held, stop)
        except FileError as exc:
            return self._refused(upload_id, upload, exc)
        except BaseException:
            stop.set()
            raise
        return {"type": DIRECT_OK, "written": upload.written}

    async def _write_upload(self, session_id: str, upload_id: str, pieces: AsyncIterator[bytes]) -> dict:
        """Write `pieces` (bytes, as they come) to the upload's temporary file
        (FileOps.upload_pieces: the declared size and the cap's room hold) on the files pool while
        the next are received: what arrives while a write is in flight (UPLOAD_HOLD_BYTES at most)
        goes in the next one, one writev; the answer: DIRECT_OK {written} (the web then commits over
        the layer), or DIRECT_REFUSED {error, detail}, the upload dropped. What `pieces` raises
        (the web's client went away) goes to the caller, the upload kept for the web's abort."""
        upload = self._found(session_id, upload_id)
        if upload is None:
            return {"type": DIRECT_REFUSED, "error": "upload-gone", "detail": "no such upload"}
        loop = asyncio.get_running_loop()
        writing: asyncio.Future | None = None  # the pieces being written on the pool, while the next are received
        held: list[bytes] = []
        holding = 0
        try:
            try:
                async for data in pieces:
                    held.append(data)
                    holding += len(data)
                    if writing is not None and not writing.done() and holding < UPLOAD_HOLD_BYTES:
                        continue
                    if writing is not None:
                        await writing
                    writing = loop.run_in_executor(self.pool, FileOps.upload_pieces, upload, held)
                    held, holding = [], 0
                if writing is not None:
                    await writing
                    writing = None
                if held:
                    await loop.run_in_executor(self.pool, FileOps.upload_pieces, upload, held)
            except OSError as exc:
                raise FileError("failed", exc.strerror or str(exc)) from None
            finally:
                if writing is not None:  # the web's client went away (what `pieces` raised goes on): the write ends first
                    await asyncio.gather(writing, return_exceptions=True)
        except FileError as exc:
            return self._refused(upload_id, upload, exc)
        return {"type": DIRECT_OK, "written": upload.written}

    def _expire(self) -> None:
        """Abandon uploads untouched for UPLOAD_IDLE_S or whose session ended."""
        horizon = time.monotonic() - UPLOAD_IDLE_S
        with self.lock:
            stale = [
                key
                for key, (session_id, upload) in self.uploads.items()
                if upload.touched < horizon or session_id not in self.agent.sessions
            ]
            dropped = [self.uploads.pop(key)[1] for key in stale]
        for upload in dropped:
            FileOps.upload_close(upload, remove=True)
