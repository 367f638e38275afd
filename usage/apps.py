from django.apps import AppConfig


class UsageConfig(AppConfig):
    """What sessions and devices use (issue 15): the agents' samples, their 5-minute means,
    accounting (GPU-hours), Prometheus metrics and idle reclamation."""

    name = "usage"
    verbose_name = "Usage"
    default_auto_field = "django.db.models.BigAutoField"
