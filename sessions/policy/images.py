"""Session images (`SessionImage`): which one a launch gets, and an administrator's writes.

A launch names a registered reference (`"image": "nvcr.io/nvidia/pytorch:24.05-py3"`) or none,
and then gets the default image: the one marked `is_default`, else the built-in "host". The
scheduler places a session only on a node whose agent reports holding its image
(`accelerators.selectors.node_runs_image`; the agent's report: `protocol`, "images").
"""

from __future__ import annotations

import logging

from django.db import transaction

import protocol
from accelerators.models import Node, NodeStatus
from accelerators.selectors import node_runs_image
from common.errors import ApplicationError
from sessions.models import ACTIVE_STATUSES, SessionImage, SessionStatus
from sessions.service_ports import SERVICE_PORTS_LABEL, ServicePortsError, apps_from_service_ports

log = logging.getLogger(__name__)

LISTED_IN_ERRORS = 20  # registered references an "unknown image" refusal names at most
NO_ROOM_WITH_IMAGE = "no alive node with image {image} could hold it"  # nodes have it, but too small


def image_wait_reason(*, reference: str) -> str:
    """ "" when an ALIVE node holds session image `reference`; else why a session in it waits:
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
    return (
        SessionImage.objects.filter(is_default=True).first() or SessionImage.objects.filter(reference=protocol.HOST_IMAGE).first()
    )


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
        known = list(references[: LISTED_IN_ERRORS + 1])
        listed = ", ".join(known[:LISTED_IN_ERRORS]) + (", …" if len(known) > LISTED_IN_ERRORS else "")
        message = f"no registered image {reference!r} (registered: {listed or 'none'})"
        raise ApplicationError(
            f"image: {message}", type="unknown-image", title="Unknown image", field_errors={"image": [message]}
        )
    if slot and image.accelerators and slot not in image.accelerators:
        message = f"image {image.reference} supports {', '.join(image.accelerators)} only; this request asks for {slot}"
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
            raise ApplicationError(
                f"{in_use} session(s) waiting or running in image {image.reference} use it; delete it once they ended",
                type="image-in-use",
                title="Image in use",
                status=409,
            )
        image.delete()


def image_service_ports_apply(*, node_name: str, images, service_ports) -> list[str]:
    """Give the image records the `ai.backend.service-ports` labels a docker node found on the
    images it holds (`images`: {reference: image id}; `service_ports`: {image id: label}, from the
    images' inspect): a record whose reference names one of them (as it is or in
    `protocol.image_key` form) gets the label in its `labels`, whence its apps
    (sessions.service_ports.merged_apps; the record's own `apps` win by name). Only a changed
    label is written (compare-and-set on the labels read, so an administrator's edit meanwhile is
    not overwritten; the next heartbeat tries again). A malformed label is refused whole: logged
    as a warning naming the node, the image and the rule it breaks, the record left as it was.
    Returns the references of the records changed."""
    if not isinstance(images, dict) or not isinstance(service_ports, dict):
        log.warning("node %s reported image labels that are not objects: ignored", node_name)
        return []
    labels = {}
    for reference, ident in images.items():
        label = service_ports.get(ident)
        if isinstance(reference, str) and isinstance(label, str) and label:
            labels[protocol.image_key(reference)] = label
    if not labels:
        return []
    changed = []
    for image in SessionImage.objects.exclude(reference=protocol.HOST_IMAGE).only("id", "reference", "labels"):
        label = labels.get(protocol.image_key(image.reference))
        current = image.labels if isinstance(image.labels, dict) else {}
        if label is None or current.get(SERVICE_PORTS_LABEL) == label:
            continue
        try:
            apps, notes = apps_from_service_ports(label)
        except ServicePortsError as exc:
            log.warning(
                "node %s: image %s carries a malformed label, not taken (the record keeps its apps): %s",
                node_name,
                image.reference,
                exc,
            )
            continue
        if (
            SessionImage.objects.filter(pk=image.pk, labels=image.labels).update(labels={**current, SERVICE_PORTS_LABEL: label})
            == 1
        ):
            changed.append(image.reference)
            log.info(
                "image %s: apps from its %s label on node %s: %s%s",
                image.reference,
                SERVICE_PORTS_LABEL,
                node_name,
                ", ".join(a["name"] for a in apps) or "none",
                f" (left out: {'; '.join(notes)})" if notes else "",
            )
    return changed
