from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_login_failed

        from accounts import throttle

        # Every failed authenticate() counts, whichever page or endpoint called it (login page,
        # token endpoint, admin login).
        user_login_failed.connect(throttle.on_login_failed, dispatch_uid="accounts.throttle.on_login_failed")
