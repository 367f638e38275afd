from django.apps import AppConfig


class ComputeSessionsConfig(AppConfig):
    name = "sessions"
    # `sessions` would clash with django.contrib.sessions.
    label = "compute_sessions"
    verbose_name = "Compute sessions"
    default_auto_field = "django.db.models.BigAutoField"
