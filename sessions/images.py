"""Session images (`SessionImage`): which one a launch gets, and an administrator's writes.

A launch names a registered reference (`"image": "nvcr.io/nvidia/pytorch:24.05-py3"`) or none,
and then gets the default image: the one marked `is_default`, else the built-in "host". The
scheduler places a session only on a node whose agent reports holding its image
(`accelerators.selectors.node_runs_image`; the agent's report: `protocol`, "images").
"""
from __future__ import annotations

from django.db import transaction

import protocol
from accelerators.models import Node, NodeStatus
from accelerators.selectors import node_runs_image
from console.errors import ApplicationError
from sessions.models import ACTIVE_STATUSES, SessionImage, SessionStatus

LISTED_IN_ERRORS = 20  # registered references an "unknown image" refusal names at most
NO_ROOM_WITH_IMAGE = "no alive node with image {image} could hold it"  # nodes have it, but too small


def image_wait_reason(*, reference: str) -> str:
    """"" when an ALIVE node holds session image `reference`; else why a session in it waits:
    "waiting for a node with image X: no node has it", or "…: the nodes that have it are not
    alive (LOST)"."""
    statuses = set(Node.objects.filter(node_runs_image(reference)).values_list("status", flat=True))
    if NodeStatus.ALIVE in statuses:
        return ""
    why = "the nodes that have it are not alive (LOST)" if statuses else "no node has it"
    return f"waiting for a node with image {reference}: {why}"


def image_default() -> SessionImage | None:
    """The image of a launch that names none: the one marked default, else the built-in "host"
    (None when neither exists: then the session may run on any node, in the node's own default)."""
    return (SessionImage.objects.filter(is_default=True).first()
            or SessionImage.objects.filter(reference=protocol.HOST_IMAGE).first())


def image_get(*, reference: str) -> SessionImage | None:
    """The registered image `reference` names: the same text, else the one whose
    `protocol.image_key` form is the same ("ubuntu" finds "docker.io/library/ubuntu:latest")."""
    found = SessionImage.objects.filter(reference=reference).first()
    if found is not None:
        return found
    key = protocol.image_key(reference)
    same = [image for image in SessionImage.objects.all() if protocol.image_key(image.reference) == key]
    return same[0] if len(same) == 1 else None


def image_for_launch(*, reference: str | None, slot: str) -> SessionImage | None:
    """The image a launch runs in: `reference` (None or "": the default, `image_default`),
    checked against the request's accelerator `slot` ("cuda"; "" for CPU only). Raises
    ApplicationError 400 (type "unknown-image", field `image`) for a reference no administrator
    registered, listing the registered ones, and (type "invalid-image") for an image whose
    `accelerators` leave out the request's slot."""
    if not reference:
        return image_default()
    image = image_get(reference=reference)
    if image is None:
        references = SessionImage.objects.order_by("reference").values_list("reference", flat=True)
        known = list(references[:LISTED_IN_ERRORS + 1])
        listed = ", ".join(known[:LISTED_IN_ERRORS]) + (", …" if len(known) > LISTED_IN_ERRORS else "")
        message = f"no registered image {reference!r} (registered: {listed or 'none'})"
        raise ApplicationError(f"image: {message}", type="unknown-image", title="Unknown image",
                               field_errors={"image": [message]})
    if slot and image.accelerators and slot not in image.accelerators:
        message = (f"image {image.reference} supports {', '.join(image.accelerators)} only; this request asks "
                   f"for {slot}")
        raise ApplicationError(f"image: {message}", type="invalid-image", field_errors={"image": [message]})
    return image


def image_sessions_waiting_or_active(*, image: SessionImage) -> int:
    """How many sessions that have not ended (PENDING or active) run in `image`."""
    return image.sessions.filter(status__in=(SessionStatus.PENDING, *ACTIVE_STATUSES)).count()


def image_save(*, image: SessionImage) -> SessionImage:
    """Save `image` (new or changed, validated by the caller); one marked default takes the
    mark from the image that had it, in the same transaction (rows locked in that order, so two
    administrators marking two images leave exactly one default)."""
    with transaction.atomic():
        if image.is_default:
            others = SessionImage.objects.select_for_update().filter(is_default=True).exclude(pk=image.pk)
            for other in others:
                other.is_default = False
                other.save(update_fields=["is_default"])
        image.save()
    return image


def image_delete(*, image: SessionImage) -> None:
    """Delete `image`. Raises ApplicationError 409 (type "image-in-use") while sessions that have
    not ended run in it; ended sessions keep no image (their `image` becomes empty)."""
    with transaction.atomic():
        in_use = image_sessions_waiting_or_active(image=image)
        if in_use:
            raise ApplicationError(f"{in_use} session(s) waiting or running in image {image.reference} use it; delete "
                                   "it once they ended", type="image-in-use", title="Image in use", status=409)
        image.delete()
