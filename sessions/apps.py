from django.apps import AppConfig


class ComputeSessionsConfig(AppConfig):
    name = "sessions"
    # `sessions` would clash with django.contrib.sessions.
    label = "compute_sessions"
    verbose_name = "Compute sessions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accelerators.services import node_capacity_changed

        # The manager's tasks, registered with the Celery app in every process (the web's too):
        # sessions.passes asks for a pass by the task's name, which an eager Celery (tests,
        # FGPU_CELERY_EAGER) runs only when it is registered here.
        from sessions import tasks  # noqa: F401

        node_capacity_changed.connect(_node_capacity_changed, dispatch_uid="sessions-schedule-on-node-capacity")


def _node_capacity_changed(sender, node, **kwargs) -> None:
    """An administrator changed what `node` can hold (accelerators.services.node_capacity_changed,
    after commit): room may have appeared for waiting sessions, so ask for a scheduler pass."""
    from sessions.passes import schedule_pending_soon

    schedule_pending_soon()
