"""REST API for a session's files (`/api/v1/sessions/<id>/files/…`, issue 18). Thin: validate →
fetch the session with the permission check (owner or administrator; anyone else 404) → one
service of sessions.serving.files, whose wait for the agent is answered on the event loop, holding no
web thread and no database connection (common.api_async)."""

from __future__ import annotations

from django.http import StreamingHttpResponse
from django.utils.http import content_disposition_header
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers, status
from rest_framework.decorators import api_view

from common.request_body import BODY_KEY
from common.api_async import AwaitedResponse, awaiting_view
from common.api_support import ErrorSerializer
from common.errors import ApplicationError
from protocol.files import DATA_DIR
from sessions.serving import files
from sessions.selectors import session_to_change_for


class FileEntrySerializer(serializers.Serializer):
    name = serializers.CharField()
    type = serializers.ChoiceField(
        choices=["dir", "file", "link", "other"], help_text="a symbolic link is shown as a link and never followed"
    )
    size = serializers.IntegerField(help_text="bytes (0 for anything but a file)")
    mtime = serializers.IntegerField(help_text="last change, epoch seconds")
    persistent = serializers.BooleanField(
        required=False, help_text=f"`{DATA_DIR}` in the home: your persistent folder, kept across sessions"
    )
    read_only = serializers.BooleanField(  # type: ignore[assignment]  # a declared field: DRF's metaclass takes it off the class
        required=False, help_text="in `shared/`: the folder is shared with the session's owner read-only (writes answer 403)"
    )


class FileListSerializer(serializers.Serializer):
    path = serializers.CharField(allow_blank=True, help_text="the folder listed, relative to the home")
    entries = FileEntrySerializer(many=True)
    truncated = serializers.BooleanField(help_text="the folder holds more than 5,000 entries; these are the first")


class FolderCreateSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=4096, help_text="the folder to make, relative to the home")


SESSION_ID = OpenApiParameter("session_id", OpenApiTypes.UUID, OpenApiParameter.PATH)
PATH = OpenApiParameter(
    "path",
    OpenApiTypes.STR,
    description=(
        f"relative to the session's home (`{DATA_DIR}/…`: your persistent folder, `projects/<name>/…`: a project's, "
        "`shared/<name>/…`: a folder shared with you, read-only unless shared read-write); no "
        "`..`, no leading `/`, no control characters; symbolic links are not followed"
    ),
)
ERRORS = {
    400: OpenApiResponse(
        ErrorSerializer,
        description="a refused path (`bad-path`, `symlink`), or the wrong kind of "
        "entry (`not-a-directory`, `is-a-directory`, `not-a-file`)",
    ),
    404: OpenApiResponse(ErrorSerializer, description="no such session (or not yours), or no such file"),
    409: OpenApiResponse(ErrorSerializer, description="the session is not RUNNING (`session-not-running`)"),
    503: OpenApiResponse(
        ErrorSerializer, description="the session's node is down (`node-down`; says whether its data folders are local to it)"
    ),
    504: OpenApiResponse(ErrorSerializer, description="the session's agent did not answer (`files-timeout`)"),
}

WRITE_REFUSED = OpenApiResponse(ErrorSerializer, description="a folder shared with you read-only (`read-only`)")


def _session(request, session_id):
    return session_to_change_for(user=request.user, session_id=session_id)


@extend_schema_view(
    get=extend_schema(
        summary="List a folder of a session",
        parameters=[SESSION_ID, PATH],
        responses={200: FileListSerializer, **ERRORS},
        description="The entries of a folder in a RUNNING session's home (default: the home itself), "
        "folders first. `data` in the home is your persistent folder: it is kept across "
        "sessions and mounted into each new one.",
        examples=[
            OpenApiExample(
                "The home",
                response_only=True,
                value={
                    "path": "",
                    "truncated": False,
                    "entries": [
                        {"name": "data", "type": "dir", "size": 0, "mtime": 1764126000, "persistent": True},
                        {"name": "train.py", "type": "file", "size": 2048, "mtime": 1764126300},
                    ],
                },
            )
        ],
    ),
    post=extend_schema(
        summary="Make a folder in a session",
        parameters=[SESSION_ID],
        request=FolderCreateSerializer,
        responses={201: FileEntrySerializer, **ERRORS, 403: WRITE_REFUSED},
        examples=[OpenApiExample("A folder", request_only=True, value={"path": "data/runs/1"})],
    ),
    delete=extend_schema(
        summary="Delete a file or folder of a session",
        parameters=[SESSION_ID, PATH],
        responses={
            204: None,
            **ERRORS,
            403: OpenApiResponse(
                ErrorSerializer, description="under `.fgpu/` (the console's own files) or a read-only shared folder (`read-only`)"
            ),
        },
        description="Deletes a file, a symbolic link (the link itself, not what it points at) or a folder with everything in it.",
    ),
)
@awaiting_view
@api_view(["GET", "POST", "DELETE"])
def files_view(request, session_id):
    """GET `?path=` → the folder's entries; POST `{"path"}` → make a folder; DELETE `?path=` → delete."""
    session = _session(request, session_id)
    if request.method == "POST":
        data = FolderCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        made = files.session_folder_make(session=session, path=data.validated_data["path"])
        return AwaitedResponse(_shown(made, FileEntrySerializer), status=status.HTTP_201_CREATED)
    path = request.query_params.get("path", "")
    if request.method == "DELETE":
        return AwaitedResponse(files.session_file_delete(session=session, path=path), status=status.HTTP_204_NO_CONTENT)
    return AwaitedResponse(_shown(files.session_files_list(session=session, path=path), FileListSerializer))


def _shown(wait, serializer):
    """The wait whose result is `wait()`'s, shown by `serializer` (on plain data: no database)."""

    async def shown():
        return serializer(await wait()).data

    return shown


@extend_schema_view(
    get=extend_schema(
        summary="Download a file of a session",
        parameters=[SESSION_ID, PATH],
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **ERRORS},
        description="The file's bytes, streamed as the session's agent sends them (over a connection of "
        "their own to the agent, else 256 KiB at a time through the channel layer), with `Content-Length` and "
        "`Content-Disposition: attachment`.",
    ),
    put=extend_schema(
        summary="Upload a file to a session",
        parameters=[SESSION_ID, PATH],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            201: FileEntrySerializer,
            **ERRORS,
            403: WRITE_REFUSED,
            413: OpenApiResponse(
                ErrorSerializer,
                description="the file would bring the folder past your cap (`over-cap`, "
                "FGPU_FILES_USER_CAP bytes per persistent folder and per session "
                "home)",
            ),
        },
        description="The request body (any content type) is the file's bytes; missing folders on the "
        "way are made. The file replaces one at `path` once all of it arrived: a failed "
        "upload leaves no partial file. Sent on to the agent as the web server receives it, so a "
        "client's upload progress (e.g. XMLHttpRequest's `upload.onprogress`) is the "
        "progress of the transfer to the session.",
    ),
)
@awaiting_view
@api_view(["GET", "PUT"])
def file_content_view(request, session_id):
    """GET `?path=` → the file's bytes; PUT `?path=` with the bytes as the body → 201 its entry."""
    session = _session(request, session_id)
    path = request.query_params.get("path", "")
    if request.method == "PUT":
        raw = request._request  # the body as it came, read in chunks (never request.body: no size limit applies)
        streamed = getattr(raw, "scope", {}).get(BODY_KEY)  # under ASGI: read as it arrives (common.request_body)
        length = raw.META.get("CONTENT_LENGTH") or None
        try:
            size = None if length is None else int(length)
        except ValueError:
            raise ApplicationError("Content-Length is not a number", field_errors={"Content-Length": ["a number"]}) from None
        written = files.session_file_upload(session=session, path=path, body=raw if streamed is None else streamed, size=size)
        return AwaitedResponse(_shown(written, FileEntrySerializer), status=status.HTTP_201_CREATED)
    return AwaitedResponse(_streamed(files.session_file_download(session=session, path=path)))


def _streamed(wait):
    """The wait answering the download `wait()` starts (sessions.serving.files.session_file_download)
    as a response streaming its chunks as they come."""

    async def streamed():
        name, size, chunks = await wait()
        response = StreamingHttpResponse(chunks, content_type="application/octet-stream")
        response["Content-Length"] = str(size)
        response["Content-Disposition"] = content_disposition_header(True, name)
        response["X-Content-Type-Options"] = "nosniff"
        response["Cache-Control"] = "no-store"
        return response

    return streamed
