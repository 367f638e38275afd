"""REST API of shared data folders (issue 36.5; rules in sessions.policy.shares):
`GET /api/v1/shares/` (the shares the caller manages and those they receive, and the folders
they may share), `POST /api/v1/shares/` (share a folder with a user or a project, read-only or
read-write; sharing again changes the permission), `DELETE /api/v1/shares/<id>/` (the owner or
an administrator revokes a share, its grantee user leaves it). Thin: validate → one service."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import api_view
from rest_framework.response import Response

from common.api_support import ErrorSerializer
from protocol.files import DATA_DIR, PROJECTS_DIR, SHARED_DIR
from sessions.models import FolderShare, Project, SharePermission
from sessions.policy import shares

PERMISSION_HELP = '"ro": read-only (mounted read-only on the node; the file API refuses writes), "rw": read-write'


class ShareSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    folder = serializers.CharField(
        help_text=f'the folder as its side names it: "{DATA_DIR}" (a user\'s) or "{PROJECTS_DIR}/<name>"'
    )
    name = serializers.CharField(help_text=f"where recipients see it: ~/{SHARED_DIR}/<name> in their sessions and Files panel")
    owner = serializers.CharField(allow_null=True, help_text="the user whose ~/data it is (null: a project's folder)")
    project = serializers.CharField(allow_null=True, help_text="the project whose folder it is (null: a user's ~/data)")
    user = serializers.CharField(allow_null=True, help_text="the user it is shared with (null: a project)")
    to_project = serializers.CharField(allow_null=True, help_text="the project whose members it is shared with (null: a user)")
    permission = serializers.ChoiceField(SharePermission.values, help_text=PERMISSION_HELP)
    managed = serializers.BooleanField(help_text="the caller may change or revoke it (its folder's owner, or an administrator)")
    received = serializers.BooleanField(help_text="shared with the caller (directly or through a project)")
    created_at = serializers.DateTimeField()


class ShareListSerializer(serializers.Serializer):
    shares = ShareSerializer(many=True)
    folders = serializers.ListField(
        child=serializers.CharField(), help_text=f'the folders the caller may share: "{DATA_DIR}", and "{PROJECTS_DIR}/<name>"'
    )


class ShareCreateSerializer(serializers.Serializer):
    folder = serializers.CharField(
        max_length=200, help_text=f'"{DATA_DIR}" (your persistent folder) or "{PROJECTS_DIR}/<name>" (administrators)'
    )
    user = serializers.CharField(max_length=150, required=False, allow_blank=True, help_text="a user name")
    project = serializers.CharField(max_length=64, required=False, allow_blank=True, help_text="or a project name")
    permission = serializers.ChoiceField(SharePermission.values, default=SharePermission.READ_ONLY, help_text=PERMISSION_HELP)


def share_shape(share: FolderShare, *, user, member_of: set) -> dict:
    """The API's shape of `share` for `user` (`member_of`: the ids of their projects)."""
    return {
        "id": share.pk,
        "folder": f"{PROJECTS_DIR}/{share.project.name}" if share.project is not None else DATA_DIR,
        "name": share.share_name,
        "owner": share.owner.get_username() if share.owner is not None else None,
        "project": share.project.name if share.project is not None else None,
        "user": share.user.get_username() if share.user is not None else None,
        "to_project": share.to_project.name if share.to_project is not None else None,
        "permission": share.permission,
        "managed": bool(user.is_staff or share.owner_id == user.pk),
        "received": share.user_id == user.pk or share.to_project_id in member_of,
        "created_at": share.created_at,
    }


@extend_schema(
    methods=["GET"],
    summary="Shared data folders: yours and those shared with you",
    responses={200: ShareListSerializer},
    description="The shares of folders you manage (your ~/data; administrators: every share) and of folders shared "
    f"with you or your projects, which your new sessions get at ~/{SHARED_DIR}/<name>; and the folders you may share.",
)
@extend_schema(
    methods=["POST"],
    summary="Share a data folder",
    request=ShareCreateSerializer,
    responses={
        201: ShareSerializer,
        400: OpenApiResponse(ErrorSerializer, description="a bad folder, permission, user or project"),
        403: OpenApiResponse(ErrorSerializer, description="a project's folder and you are no administrator"),
        404: OpenApiResponse(ErrorSerializer, description="no such project folder"),
    },
    description='Share your ~/data (`folder` "data") or, as an administrator, a project\'s folder '
    '("projects/<name>") with a user or a project, read-only ("ro") or read-write ("rw"). Sharing the same folder '
    "with the same user or project again changes the permission. Sessions started from now on mount it; a running "
    "one does at its next start.",
    examples=[
        OpenApiExample("Read-only with a user", value={"folder": "data", "user": "bob", "permission": "ro"}, request_only=True)
    ],
)
@api_view(["GET", "POST"])
def shares_view(request):
    user = request.user
    member_of = set(user.projects.values_list("pk", flat=True))
    if request.method == "GET":
        rows = [share_shape(s, user=user, member_of=member_of) for s in shares.folder_shares_for(user=user)]
        projects = Project.objects.all() if user.is_staff else Project.objects.none()
        folders = [DATA_DIR, *(f"{PROJECTS_DIR}/{name}" for name in projects.values_list("name", flat=True))]
        return Response(ShareListSerializer({"shares": rows, "folders": folders}).data)
    body = ShareCreateSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    share = shares.folder_share_set(actor=user, **body.validated_data)
    share = FolderShare.objects.select_related("owner", "project", "user", "to_project").get(pk=share.pk)
    return Response(ShareSerializer(share_shape(share, user=user, member_of=member_of)).data, status=status.HTTP_201_CREATED)


@extend_schema(
    summary="Revoke or leave a shared folder",
    request=None,
    responses={
        204: None,
        403: OpenApiResponse(ErrorSerializer, description="a share with your project: its folder's owner revokes it"),
        404: OpenApiResponse(ErrorSerializer, description="no such share, or none of yours"),
    },
    description="Its folder's owner or an administrator revokes the share; the user it was shared with leaves it. "
    "The file API stops at once; new sessions no longer mount it; a running session keeps its mount until it ends.",
)
@api_view(["DELETE"])
def share_view(request, share_id):
    shares.folder_share_revoke(actor=request.user, share_id=share_id)
    return Response(status=status.HTTP_204_NO_CONTENT)
