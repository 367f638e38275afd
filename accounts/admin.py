from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.utils import timezone
from rest_framework.authtoken.models import TokenProxy

from accelerators.admin_display import when_html
from accounts import throttle
from accounts.services import login_token_revoke
from accounts.models import ApiToken, LoginToken, TokenKind

User = get_user_model()


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created by their users on the profile page (the key is shown only there);
    administrators list and revoke them here."""

    list_display = ["name", "user", "key_prefix", "created", "last_used", "revoked"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "user__username", "prefix"]
    fields = readonly_fields = ("user", "name", "key_prefix", "created", "last_used", "revoked")
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).filter(kind=TokenKind.NAMED)  # login tokens: their own section

    @admin.display(description="key starts with", ordering="prefix")
    def key_prefix(self, obj: ApiToken) -> str:
        return f"{obj.prefix}…"

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: ApiToken) -> str:
        return when_html(obj.created_at)

    @admin.display(description="last used", ordering="last_used_at")
    def last_used(self, obj: ApiToken) -> str:
        return when_html(obj.last_used_at) if obj.last_used_at else "never"

    @admin.display(description="revoked", ordering="revoked_at")
    def revoked(self, obj: ApiToken) -> str:
        return when_html(obj.revoked_at) if obj.revoked_at else "no (works)"

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        revoked = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {revoked} token{'s' if revoked != 1 else ''}.", messages.SUCCESS)


# DRF's authtoken registers its own "Auth Token › Tokens" section, showing whole keys; the login
# tokens are listed in Accounts instead, beside the named ones, by their first characters only.
if admin.site.is_registered(TokenProxy):
    admin.site.unregister(TokenProxy)


@admin.register(LoginToken)
class LoginTokenAdmin(admin.ModelAdmin):
    """The tokens users' passwords got from `POST /api/v1/auth/token/` (`fgpu login`), listed by
    their first characters (only their digests are stored); revoke them from the users list:
    "Revoke login tokens (sign out of fgpu)"."""

    list_display = ["user", "key_prefix", "issued", "last_used"]
    list_display_links = None
    search_fields = ["user__username", "prefix"]
    list_select_related = ["user"]
    actions = None

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="key starts with", ordering="prefix")
    def key_prefix(self, obj: LoginToken) -> str:
        return f"{obj.prefix}…"

    @admin.display(description="issued", ordering="created_at")
    def issued(self, obj: LoginToken) -> str:
        return when_html(obj.created_at)

    @admin.display(description="last used", ordering="last_used_at")
    def last_used(self, obj: LoginToken) -> str:
        return when_html(obj.last_used_at) if obj.last_used_at else "never"


admin.site.unregister(User)


@admin.register(User)
class ConsoleUserAdmin(UserAdmin):
    """Django's user admin, with an unlock for users the login throttle locked out."""

    actions = ["clear_failed_logins", "revoke_login_tokens"]

    @admin.action(description="Clear failed logins (unlock)")
    def clear_failed_logins(self, request, queryset):
        names = list(queryset.values_list("username", flat=True))
        for name in names:
            throttle.login_failures_clear_user(username=name)
        self.message_user(
            request,
            f"Cleared the failed logins of {', '.join(names)}: they may sign in again from "
            f"every address (an address locked as a whole: manage.py login_unlock --address).",
            messages.SUCCESS,
        )

    @admin.action(description="Revoke login tokens (sign out of fgpu)")
    def revoke_login_tokens(self, request, queryset):
        """Deletes the selected users' login tokens (`accounts.services.login_token_revoke`); their
        named API tokens stay (revoke those under API tokens)."""
        names = [user.username for user in queryset if login_token_revoke(user=user)]
        self.message_user(
            request,
            f"Revoked the login token of {', '.join(names)}: `fgpu login` gets a new one."
            if names
            else "None of them had a login token.",
            messages.SUCCESS,
        )
