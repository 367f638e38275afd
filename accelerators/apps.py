from django.apps import AppConfig


class AcceleratorsConfig(AppConfig):
    name = "accelerators"
    verbose_name = "Accelerators"
    default_auto_field = "django.db.models.BigAutoField"
