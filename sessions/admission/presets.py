"""Resource presets (`ResourcePreset`): named requests administrators define and users launch
(Backend.AI's resource presets, Run:ai's compute resources).

A preset is checked exactly as a launch is (`preset_check`: the same parsing, slot mode, quantum,
resource group, image and "could any registered node ever hold it" checks as
`sessions.admission.launch.session_create`), when an administrator saves it.

A launch by preset (`{"preset": "<name or id>"}` in `POST /api/v1/sessions/` and its preview,
`launch_with_preset`) starts from the preset's request and merges what the body adds:

- keys of the body's `resources` replace the preset's: `cpu`, `mem` and the options (`strategy`,
  `policy`, `numa`, `devices`, `exclude`) one by one; any GPU key (`cuda.shares`, `gpu`,
  `gpu_fraction`, `mig_profile`, …) replaces the preset's whole GPU request, since a session
  has one request style (the preset's fGPU `strategy` goes with it); a key sent as null
  removes the preset's (`{"cuda.shares": null}`: CPU only);
- the body's `image` replaces the preset's;
- `name`, `command`, `priority` are the body's;
- the preset's resource group is its scope: a body naming another `resources.resource_group`
  (or null) is refused (400, type "preset-conflict").

A preset alone therefore launches exactly the preset's request (`ResourcePreset.request()`).
"""

from __future__ import annotations

import uuid

from django.db.models import Q, QuerySet

from accelerators.allocation.errors import NeverSchedulable
from accelerators.allocation.requests import COMMON
from common.errors import ApplicationError
from sessions.scheduling import mig as mig_scheduling
from sessions.policy.group_access import resource_groups_usable_by
from sessions.policy.images import image_for_launch
from sessions.models import ResourcePreset
from sessions.scheduling.placement import ReadView
from sessions.scheduling.placement import request_validate

OWN_FIELDS = {"cpu": "cpu", "mem": "mem", "resource_group": "resource_group"}  # request keys with columns
LISTED_IN_ERRORS = 20  # preset names an "unknown preset" refusal lists at most


def preset_check(*, preset: ResourcePreset) -> None:
    """Check `preset` as a launch of its request is checked: `resources` an object without the
    keys that have their own fields (`cpu`, `mem`, `resource_group`), then
    `sessions.scheduling.placement.request_validate` (malformed, wrong mode, off the quantum, unknown group),
    the image (`sessions.policy.images.image_for_launch`) and the launch's admission without its quotas
    (type "never-schedulable" when no registered node of its group, LOST ones included, could
    ever hold it). Raises ApplicationError (400) whose `field_errors` name the preset's field:
    `resources` or `image`."""
    if not isinstance(preset.resources, dict):
        raise _invalid("resources", 'an object such as {"cuda.shares": "0.25"} ({} for CPU only)')
    for key, field in OWN_FIELDS.items():
        if key in preset.resources:
            raise _invalid("resources", f"{key!r} has its own field ({field}); leave it out of the GPU request")
    request, pure_settings = request_validate(resources=preset.request())
    image_for_launch(reference=preset.image.reference if preset.image else None, slot=request.slot)
    try:  # the launch's admission (every registered node, LOST ones too), without its quotas
        mig_scheduling.check_ever_fits(request, lambda: ReadView().check_ever_fits(request, pure_settings))
    except NeverSchedulable as exc:
        raise ApplicationError(
            str(exc), type="never-schedulable", title="Request too large", field_errors={"resources": [str(exc)]}
        ) from None


def _invalid(field: str, message: str) -> ApplicationError:
    return ApplicationError(f"{field}: {message}", type="invalid-preset", field_errors={field: [message]})


def preset_save(*, preset: ResourcePreset) -> ResourcePreset:
    """`preset_check` then save `preset` (new or changed). Raises as `preset_check`."""
    preset_check(preset=preset)
    preset.save()
    return preset


def preset_list_for(*, user) -> QuerySet[ResourcePreset]:
    """The presets `user` may launch, by name: those without a resource group and those of the
    groups `user` may use (`sessions.policy.group_access`); an administrator: every preset."""
    presets = ResourcePreset.objects.select_related("resource_group", "image")
    if user.is_staff:
        return presets
    usable = resource_groups_usable_by(user=user).values("pk")
    return presets.filter(Q(resource_group__isnull=True) | Q(resource_group__in=usable))


def preset_get_for(*, user, reference: str) -> ResourcePreset:
    """The preset `reference` names (its id, or its name) among those `user` may launch.
    Raises ApplicationError (400, type "unknown-preset", field `preset`) listing the names
    `user` may use."""
    presets = preset_list_for(user=user)
    found = None
    try:
        found = presets.filter(pk=uuid.UUID(str(reference))).first()
    except ValueError:
        pass
    found = found or presets.filter(name=reference).first()
    if found is None:
        names = list(presets.values_list("name", flat=True)[: LISTED_IN_ERRORS + 1])
        listed = ", ".join(names[:LISTED_IN_ERRORS]) + (", …" if len(names) > LISTED_IN_ERRORS else "")
        message = f"no preset {reference!r} you may use (yours: {listed or 'none'})"
        raise ApplicationError(
            f"preset: {message}", type="unknown-preset", title="Unknown preset", field_errors={"preset": [message]}
        )
    return found


def preset_merge(*, preset: ResourcePreset, resources: dict | None) -> dict:
    """The preset's request with `resources` merged in as the module docstring says. Raises
    ApplicationError (400, type "preset-conflict", field `resources`) when `resources` names
    another resource group than the preset's."""
    merged = preset.request()
    explicit = dict(resources or {})
    if (
        preset.resource_group is not None
        and "resource_group" in explicit
        and explicit["resource_group"] != preset.resource_group.name
    ):
        message = (
            f"preset {preset.name!r} launches into resource group {preset.resource_group.name!r}; "
            f"resources.resource_group {explicit['resource_group']!r} conflicts with it (leave it out)"
        )
        raise ApplicationError(
            message, type="preset-conflict", title="Conflicts with the preset", field_errors={"resources": [message]}
        )
    if any(key not in COMMON for key in explicit):  # a GPU request of its own: one style per session
        merged = {key: value for key, value in merged.items() if key in COMMON and key != "strategy"}
    for key, value in explicit.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def launch_with_preset(*, user, data: dict) -> dict:
    """A launch body's validated fields (`name`, `resources`, `command`, `priority`, `image`,
    `preset`) → the fields `session_create` and `launch_preview` take: without `preset`, `data`
    minus it; with one, `resources` and `image` merged as the module docstring says. Raises
    ApplicationError 400 as `preset_get_for` and `preset_merge`."""
    data = dict(data)
    reference = data.pop("preset", None)
    if not reference:
        return data
    preset = preset_get_for(user=user, reference=reference)
    data["resources"] = preset_merge(preset=preset, resources=data.get("resources"))
    if not data.get("image") and preset.image is not None:
        data["image"] = preset.image.reference
    return data
