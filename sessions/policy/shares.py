"""Shared data folders (issue 36.5): who may share which folder with whom, and what each user's
sessions mount. Backend.AI's vfolder sharing (invitations to users, group folders shared with
projects, "ro"/"rw" permissions) is the model; here a share is granted at once, with no
invitation to accept, and the grantee may leave it (revoke it for themselves).

Folders: a user's persistent folder (written "data": the caller's ~/data) or a project's
(written "projects/<name>"). Who shares: the user their own ~/data; administrators a project's
folder (the console has no project-admin role; a member may not hand the project's data to
outsiders). Grantees: a user or a project (each of its members, now and later).

What a recipient gets (`shared_mounts`): each folder shared with them or with a project they
are a member of, at ~/shared/<name> (models.share_name: "<user>-data", "<project>-project"),
read-write where any of those shares says "rw", else read-only; never their own ~/data nor
the folder of a project they are a member of (they have it read-write at ~/projects/<name>).

Revoking takes effect at once in the file API (the web reads the grants at each call) and in
every session started after; a RUNNING session keeps the folder mounted (as it was) until it
ends: the node cannot take a bind mount out of a sandbox without stopping what runs in it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet

from common.errors import ApplicationError
from protocol.files import DATA_DIR, PROJECTS_DIR, SHARED_DIR
from sessions.models import FolderShare, Project, SharePermission, share_name


@dataclass(frozen=True)
class SharedMount:
    """One folder a user's sessions get at ~/shared/<name>: `kind` "user" (a user's ~/data) or
    "project", `id` the user's id or the project's (text), `read_only`."""

    name: str
    kind: str
    id: str
    read_only: bool

    def encode(self) -> dict:
        return {"name": self.name, "kind": self.kind, "id": self.id, "read_only": self.read_only}


def _not_found(what: str) -> ApplicationError:
    return ApplicationError(what, type="not-found", title="Not found", status=404)


def share_folder_parse(*, actor, folder: str):
    """(owner, project) of `folder` as the API names it ("data": `actor`'s ~/data;
    "projects/<name>": that project's), if `actor` may share it. Raises ApplicationError 400
    (a folder named otherwise), 404 (no such project), 403 (a project's folder and `actor` is no
    administrator)."""
    folder = (folder or "").strip().strip("/")
    if folder == DATA_DIR:
        return actor, None
    prefix = PROJECTS_DIR + "/"
    if folder.startswith(prefix) and "/" not in folder[len(prefix) :] and folder[len(prefix) :]:
        project = Project.objects.filter(name=folder[len(prefix) :]).first()
        if project is None or not (actor.is_staff or project.members.filter(pk=actor.pk).exists()):
            raise _not_found(f"no project folder {folder!r}")
        if not actor.is_staff:
            raise ApplicationError(
                "only administrators share a project's folder", type="permission-denied", title="Not allowed", status=403
            )
        return None, project
    raise ApplicationError(
        f"name the folder as {DATA_DIR!r} (your persistent folder) or '{PROJECTS_DIR}/<name>' (a project's)",
        field_errors={"folder": ["'data' or 'projects/<name>'"]},
    )


def folder_share_set(*, actor, folder: str, user: str = "", project: str = "", permission: str = "ro") -> FolderShare:
    """Share `folder` ("data" or "projects/<name>", `share_folder_parse`) with `user` (a user
    name) or `project` (a project name), one of the two, `permission` "ro" or "rw"; sharing a
    folder again with the same grantee changes its permission. Returns the share. Raises
    ApplicationError 400 (bad permission, no or both grantees, no such user or project, the
    folder's own owner or project), 403/404 as `share_folder_parse`."""
    if permission not in SharePermission.values:
        raise ApplicationError("permission is 'ro' or 'rw'", field_errors={"permission": ["'ro' or 'rw'"]})
    owner, source = share_folder_parse(actor=actor, folder=folder)
    if bool(user) == bool(project):
        raise ApplicationError("name one user or one project to share with", field_errors={"user": ["a user or a project"]})
    grantee_user = grantee_project = None
    if user:
        grantee_user = get_user_model().objects.filter(username=user, is_active=True).first()
        if grantee_user is None:
            raise ApplicationError(f"no user {user!r}", field_errors={"user": ["no such user"]})
        if owner is not None and grantee_user.pk == owner.pk:
            raise ApplicationError("the folder is your own", field_errors={"user": ["the folder's owner"]})
    else:
        grantee_project = Project.objects.filter(name=project).first()
        if grantee_project is None:
            raise ApplicationError(f"no project {project!r}", field_errors={"project": ["no such project"]})
        if source is not None and grantee_project.pk == source.pk:
            raise ApplicationError("the folder is that project's own", field_errors={"project": ["the folder's project"]})
    try:
        with transaction.atomic():
            share, created = FolderShare.objects.select_for_update().get_or_create(
                owner=owner,
                project=source,
                user=grantee_user,
                to_project=grantee_project,
                defaults={"permission": permission, "created_by": actor},
            )
            if not created and share.permission != permission:
                share.permission = permission
                share.save(update_fields=["permission"])
    except IntegrityError:  # two equal shares raced: the other won; read it
        share = FolderShare.objects.get(owner=owner, project=source, user=grantee_user, to_project=grantee_project)
    return share


def folder_shares_for(*, user) -> QuerySet[FolderShare]:
    """The shares `user` manages (of their own ~/data; administrators: all) or receives (as a user or through a project they
    are a member of), with their folders and grantees (one query)."""
    shares = FolderShare.objects.all()
    if not user.is_staff:  # an administrator manages every share
        shares = shares.filter(Q(owner=user) | Q(user=user) | Q(to_project__members=user))
    return shares.select_related("owner", "project", "user", "to_project").distinct().order_by("created_at")


def folder_share_revoke(*, actor, share_id) -> None:
    """Remove the share: its folder's owner or an administrator revokes it, its grantee user
    leaves it. Raises ApplicationError 404 (no such share, or none `actor` sees), 403 (a project
    member: a share with a project is revoked by the folder's side)."""
    try:
        share = FolderShare.objects.filter(pk=share_id).first()
    except (ValidationError, ValueError):
        share = None
    if share is None:
        raise _not_found("no such share")
    if actor.is_staff or share.owner_id == actor.pk or share.user_id == actor.pk:
        share.delete()
        return
    if share.to_project is not None and share.to_project.members.filter(pk=actor.pk).exists():
        raise ApplicationError(
            "a share with a project is revoked by the folder's owner", type="permission-denied", title="Not allowed", status=403
        )
    raise _not_found("no such share")


def shared_mounts(*, user_id: int) -> list[SharedMount]:
    """The folders shared with user `user_id` (module docstring), by name (two queries)."""
    return shared_mounts_by_user([user_id])[user_id]


def shared_mounts_by_user(user_ids, *, projects: dict[int, list[dict]] | None = None) -> dict[int, list[SharedMount]]:
    """user id → `shared_mounts` of each of `user_ids` (two queries, however many: a scheduler
    pass starts many sessions at once; one where `projects` gives each one's projects already:
    sessions.lifecycle.start_spec.owner_projects' {user id: [{"id", "name"}]})."""
    wanted = set(user_ids)
    if not wanted:
        return {}
    member_of: dict[int, set] = {user_id: set() for user_id in wanted}
    if projects is not None:
        for user_id in wanted:
            member_of[user_id] = {uuid.UUID(str(p["id"])) for p in projects.get(user_id, [])}
    else:
        links = Project.members.through.objects.filter(user_id__in=wanted).values_list("user_id", "project_id")
        for user_id, project_id in links:
            member_of[user_id].add(project_id)
    any_project = set().union(*member_of.values())
    shares = list(
        FolderShare.objects.filter(Q(user_id__in=wanted) | Q(to_project_id__in=any_project)).select_related("owner", "project")
    )
    found: dict[int, list[SharedMount]] = {}
    for user_id in wanted:
        mine = member_of[user_id]
        mounts: dict[str, SharedMount] = {}
        for share in shares:
            if not (share.user_id == user_id or share.to_project_id in mine):
                continue
            if share.owner_id == user_id or share.project_id in mine:
                continue  # their own ~/data, or their project's: theirs read-write already
            name = share_name(owner=share.owner, project=share.project)
            kind, folder_id = ("user", str(share.owner_id)) if share.owner_id else ("project", str(share.project_id))
            read_only = share.permission == SharePermission.READ_ONLY
            if name in mounts:
                read_only = read_only and mounts[name].read_only  # any "rw" share makes it writable
            mounts[name] = SharedMount(name=name, kind=kind, id=folder_id, read_only=read_only)
        found[user_id] = [mounts[name] for name in sorted(mounts)]
    return found


def shared_path_check(*, mounts: dict[str, dict], path_parts: list[str], write: bool) -> None:
    """Refuse a path under ~/shared/<name> of no share (ApplicationError 404 not-found: a revoked
    one too, whatever a running session still mounts) and a write there to a read-only share or
    to the shared folder itself (403 read-only); `mounts`: {name: SharedMount.encode()}. Paths
    elsewhere pass. The node refuses them too (agent.files, and the read-only mount)."""
    if not path_parts or path_parts[0] != SHARED_DIR or (len(path_parts) == 1 and not write):
        return
    if len(path_parts) < 2 or path_parts[1] not in mounts:
        raise _not_found("no such shared folder" if len(path_parts) > 1 else f"{SHARED_DIR}/ holds the folders shared with you")
    if not write:
        return
    if len(path_parts) == 2:
        raise ApplicationError("a shared folder itself is not changed here", type="read-only", title="Read-only", status=403)
    if mounts[path_parts[1]]["read_only"]:
        raise ApplicationError(
            f"{SHARED_DIR}/{path_parts[1]} is shared with you read-only", type="read-only", title="Read-only", status=403
        )
