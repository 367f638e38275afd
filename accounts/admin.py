from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.utils import timezone

from accounts import throttle
from accounts.models import ApiToken

User = get_user_model()


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created by their users on the profile page (the key is shown only there);
    administrators list and revoke them here."""

    list_display = ["name", "user", "prefix", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "user__username", "prefix"]
    readonly_fields = ["id", "user", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    exclude = ["digest"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        revoked = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {revoked} token{'s' if revoked != 1 else ''}.", messages.SUCCESS)


admin.site.unregister(User)


@admin.register(User)
class ConsoleUserAdmin(UserAdmin):
    """Django's user admin, with an unlock for users the login throttle locked out."""

    actions = ["clear_failed_logins"]

    @admin.action(description="Clear failed logins (unlock)")
    def clear_failed_logins(self, request, queryset):
        names = list(queryset.values_list("username", flat=True))
        for name in names:
            throttle.login_failures_clear_user(username=name)
        self.message_user(request, f"Cleared the failed logins of {', '.join(names)}: they may sign in again from "
                                   f"every address (an address locked as a whole: manage.py login_unlock --address).",
                          messages.SUCCESS)
