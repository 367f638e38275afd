"""Who may use which resource group (Backend.AI associates scaling groups with projects).

A resource group that no project names (`Project.resource_groups`) is open to everyone. One
that projects name is reserved for their members; administrators (`is_staff`) may use every
group. A launch naming a group the owner may not use is refused (`sessions.lifecycle.services.
session_create`), and the resource presets of such a group are not offered (`sessions.admission.presets`).
"""

from __future__ import annotations

from django.db.models import Q, QuerySet

from accelerators.models import ResourceGroup
from common.errors import ApplicationError


def resource_groups_usable_by(*, user) -> QuerySet[ResourceGroup]:
    """The resource groups `user` may launch into: every one for an administrator; else those no
    project names and those named by a project `user` is a member of."""
    groups = ResourceGroup.objects.all()
    if user.is_staff:
        return groups
    reserved = ResourceGroup.objects.filter(projects__isnull=False).values("pk")
    member_of = ResourceGroup.objects.filter(projects__members=user).values("pk")
    return groups.filter(~Q(pk__in=reserved) | Q(pk__in=member_of))


def resource_group_check_usable(*, user, name: str) -> None:
    """Refuse a launch by `user` into resource group `name` ("": none named, always allowed)
    that is reserved for projects `user` is not a member of. Raises ApplicationError (403, type
    "resource-group-reserved", field `resources`) naming the projects. An unknown name is left
    to `accelerators.selectors.resource_group_get` (400)."""
    if not name or user.is_staff:
        return
    group = ResourceGroup.objects.filter(name=name).first()
    if group is None or resource_groups_usable_by(user=user).filter(pk=group.pk).exists():
        return
    projects = ", ".join(sorted(group.projects.values_list("name", flat=True)))
    message = (
        f"resources.resource_group: {name!r} is reserved for the members of project(s) {projects}; "
        "ask an administrator to add you to one"
    )
    raise ApplicationError(
        message,
        type="resource-group-reserved",
        title="Resource group reserved",
        status=403,
        field_errors={"resources": [message]},
    )
