from django.apps import AppConfig


class ComputeSessionsConfig(AppConfig):
    name = "sessions"
    # `sessions` would clash with django.contrib.sessions.
    label = "compute_sessions"
    verbose_name = "Compute sessions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accelerators.drain import node_drain_changed
        from accelerators.services import node_capacity_changed, node_declared_dead

        # The manager's tasks, registered with the Celery app in every process (the web's too):
        # sessions.lifecycle.passes asks for a pass by the task's name, which an eager Celery (tests,
        # FGPU_CELERY_EAGER) runs only when it is registered here.
        from sessions import tasks  # noqa: F401
        from sessions.api.serializers import session_shapes
        from sessions.lifecycle import events

        events.shapes_renderer = session_shapes  # the notices' shapes, the API's (issue 34.3: no import upwards)

        node_capacity_changed.connect(_node_capacity_changed, dispatch_uid="sessions-schedule-on-node-capacity")
        node_declared_dead.connect(_node_declared_dead, dispatch_uid="sessions-end-on-node-dead")
        node_drain_changed.connect(_node_drain_changed, dispatch_uid="sessions-schedule-on-node-drain")


def _node_capacity_changed(sender, node, **kwargs) -> None:
    """An administrator changed what `node` can hold (accelerators.services.node_capacity_changed,
    after commit): room may have appeared for waiting sessions, so ask for a scheduler pass."""
    from sessions.lifecycle.passes import schedule_pending_soon

    schedule_pending_soon()


def _node_drain_changed(sender, node, **kwargs) -> None:
    """An administrator drained or undrained `node` (accelerators.drain, after commit): a pass
    gives a drain's eviction notices, or takes them back and places waiting sessions there again."""
    from sessions.lifecycle.passes import schedule_pending_soon

    schedule_pending_soon()


def _node_declared_dead(sender, node, reason: str, **kwargs) -> int:
    """An administrator marked LOST `node` dead (accelerators.services.node_mark_dead, inside its
    transaction): its sessions end and their devices are released. Returns how many ended."""
    from sessions.lifecycle.reconcile import node_sessions_end

    return node_sessions_end(node_name=node.name, reason=reason)
