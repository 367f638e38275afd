from django.urls import path

from accounts import views

app_name = "accounts"

urlpatterns = [
    path("", views.profile, name="profile"),
    path("tokens/", views.token_create, name="token-create"),
    path("tokens/<uuid:token_id>/revoke/", views.token_revoke, name="token-revoke"),
    path("login-token/revoke/", views.login_token_revoke, name="login-token-revoke"),
]
