"""Pages: the throttled login page and the profile page with the user's API tokens. Thin views."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts import services, throttle
from accounts.selectors import api_token_get_for, api_token_list_for, login_token_get_for
from common.errors import ApplicationError

PROFILE_TEMPLATE = "account/profile.html"
# The new token's key, between the POST that made it and the one GET of the profile that shows it
# (POST-redirect-GET): kept in the server-side session (django.contrib.sessions' database store),
# removed by that GET, or with the session at logout.
NEW_TOKEN_SESSION_KEY = "accounts.new_api_token"


class LoginView(auth_views.LoginView):
    """Django's login page, except that while the username or the client's address has too many
    recent failed logins (accounts.throttle) a POST is answered 429 with "Too many attempts, try
    again in N minutes", without checking the password."""

    def post(self, request, *args, **kwargs):
        username = request.POST.get("username", "")
        wait = throttle.login_blocked_for(username=username, ip=throttle.client_ip(request))
        if not wait:
            return super().post(request, *args, **kwargs)
        form = self.get_form_class()(request, initial={"username": username})
        context = self.get_context_data(form=form, throttled=throttle.wait_message(wait))
        return self.render_to_response(context, status=429)


class ApiTokenForm(forms.Form):
    name = forms.CharField(max_length=services.NAME_MAX_LENGTH, strip=True)


def _profile(request, *, form=None, new_key: str = "", new_token_id: str = "", status: int = 200):
    tokens = api_token_list_for(user=request.user)
    new_token = next((token for token in tokens if str(token.pk) == new_token_id), None) if new_key else None
    context = {
        "tokens": tokens,
        "login_token": login_token_get_for(user=request.user),
        "form": form or ApiTokenForm(),
        "new_key": new_key if new_token else "",  # revoked in between: not shown
        "new_token": new_token,
        "api_url": request.build_absolute_uri("/api/v1/"),
    }
    return render(request, PROFILE_TEMPLATE, context, status=status)


@never_cache
@login_required
def profile(request):
    """`/account/`: who you are and your API tokens; the first GET after a token was created shows
    its key, once (a reload shows it no more; the response is never cached)."""
    created = request.session.pop(NEW_TOKEN_SESSION_KEY, None) or {}
    return _profile(request, new_key=created.get("key", ""), new_token_id=created.get("token_id", ""))


@never_cache
@login_required
@require_POST
def token_create(request):
    """Create a named token, then redirect (303) to the profile, which shows its key once: a reload
    re-posts nothing. An invalid name is this page again, 400, with the error."""
    form = ApiTokenForm(request.POST)
    if form.is_valid():
        try:
            key, token = services.api_token_create(user=request.user, name=form.cleaned_data["name"])
        except ApplicationError as exc:
            form.add_error("name", exc.detail)
        else:
            request.session[NEW_TOKEN_SESSION_KEY] = {"key": key, "token_id": str(token.pk)}
            return HttpResponseRedirect(reverse("accounts:profile"), status=303)  # See Other: GET it
    return _profile(request, form=form, status=400)


@login_required
@require_POST
def token_revoke(request, token_id):
    """Revoke one of your own tokens (anyone else's is a 404)."""
    token = api_token_get_for(user=request.user, token_id=token_id)
    if services.api_token_revoke(token=token):
        messages.success(request, f"Token “{token.name}” ({token.prefix}…) was revoked. It no longer works.")
    return redirect("accounts:profile")


@login_required
@require_POST
def login_token_revoke(request):
    """Revoke the token `fgpu login` got for your password; the next `fgpu login` gets a new one."""
    if services.login_token_revoke(user=request.user):
        messages.success(request, "The token from fgpu login was revoked. Run fgpu login again to get a new one.")
    return redirect("accounts:profile")
