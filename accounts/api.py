"""`POST /api/v1/auth/token/`: a login token for a password (DRF's obtain-token endpoint, issuing
hashed tokens, behind the login throttle); `GET /api/v1/me/`: who the caller is."""

from __future__ import annotations

from collections.abc import Mapping

from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import exceptions, serializers
from rest_framework.decorators import api_view
from rest_framework.response import Response
from rest_framework.authtoken.serializers import AuthTokenSerializer
from rest_framework.authtoken.views import ObtainAuthToken

from accounts import throttle
from accounts.services import login_token_issue
from common.api_support import ErrorSerializer
from sessions.api.quotas import QuotaFiguresSerializer


class TooManyAttempts(exceptions.APIException):
    """429 `{"type": "too-many-attempts", "title": "Too many requests", "detail": "Too many
    attempts, try again in N minutes.", "field_errors": {}}` with `Retry-After` in seconds."""

    status_code = 429
    default_code = "too_many_attempts"

    def __init__(self, wait: int) -> None:
        super().__init__(throttle.wait_message(wait))
        self.wait = wait  # DRF's handler turns it into Retry-After


class ObtainAuthTokenView(ObtainAuthToken):
    """`{"username", "password"}` → `{"token"}`: DRF's ObtainAuthToken (its serializer checks the
    password: 400 when wrong), except that each call issues a new login token, stored as its
    SHA-256 digest (accounts.services.login_token_issue; `fgpu login` stores the key). While the
    username or the client's address has too many recent failed logins (accounts.throttle): 429,
    password not checked."""

    @extend_schema(
        request=AuthTokenSerializer,
        responses={
            200: inline_serializer("AuthToken", {"token": serializers.CharField()}),
            400: OpenApiResponse(ErrorSerializer, description="Wrong username or password, or a field missing."),
            429: OpenApiResponse(
                ErrorSerializer,
                description=(
                    "Too many failed logins for this username or from this address in 15 minutes (type "
                    "`too-many-attempts`); the `Retry-After` header gives the seconds to wait."
                ),
            ),
        },
        examples=[
            OpenApiExample("Log in", value={"username": "alice", "password": "correct horse battery"}, request_only=True),
            OpenApiExample("Token", value={"token": "Jx2dC3bQ0WJ8s1m4nS7vR9kT6yU5hL2pA8fE3gZ0cXo"}, response_only=True),
        ],
        auth=[],
    )
    def post(self, request, *args, **kwargs):
        username = request.data.get("username") if isinstance(request.data, Mapping) else None
        wait = throttle.login_blocked_for(username=str(username or ""), ip=throttle.client_ip(request))
        if wait:
            raise TooManyAttempts(wait)
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return Response({"token": login_token_issue(user=serializer.validated_data["user"])})


obtain_auth_token = ObtainAuthTokenView.as_view()


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    is_admin = serializers.BooleanField(help_text="an administrator (staff): sees every session, edits settings")
    projects = serializers.ListField(child=serializers.CharField(), help_text="names of the caller's projects")
    live_sessions = serializers.IntegerField(help_text="the caller's sessions waiting or running now")
    quota_headroom = QuotaFiguresSerializer(
        help_text="what the caller may still launch under every quota that applies (null: unlimited); "
        "GET /api/v1/quota/ has the detail"
    )


@extend_schema(
    summary="Who am I",
    tags=["accounts"],
    responses={200: MeSerializer},
    description="The caller: username, whether an administrator, projects, live sessions and quota "
    "headroom. `fgpu login` uses it to confirm a token.",
    examples=[
        OpenApiExample(
            "A user",
            response_only=True,
            value={
                "username": "alice",
                "is_admin": False,
                "projects": ["vision"],
                "live_sessions": 1,
                "quota_headroom": {"fgpu": "1.50", "devices": None, "gpu_memory": 6442450944, "sessions": 2},
            },
        )
    ],
)
@api_view(["GET"])
def me_view(request):
    """`{"username", "is_admin", "projects", "live_sessions", "quota_headroom"}` of the caller."""
    from accounts.selectors import user_summary

    return Response(MeSerializer(user_summary(user=request.user)).data)
