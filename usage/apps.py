from django.apps import AppConfig


class UsageConfig(AppConfig):
    """What sessions and devices use (issue 15): the agents' samples, their 5-minute means,
    accounting (GPU-hours), Prometheus metrics and idle reclamation."""

    name = "usage"
    verbose_name = "Usage"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accelerators import fleet
        from sessions import usage_reads
        from usage.selectors import FleetDeviceSamples, SessionsUsageReads

        # What the apps below read of usage, through interfaces they define (issue 34.3: no import upwards).
        usage_reads.reads = SessionsUsageReads()
        fleet.samples = FleetDeviceSamples()
