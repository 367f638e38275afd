"""REST API for sessions (`/api/v1/`). Thin: validate → fetch with permission check → one service."""
from __future__ import annotations

from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.response import Response

from sessions import services
from sessions.launch import launch_options, launch_preview
from sessions.selectors import session_get_for, session_list_for
from sessions.serializers import SessionCreateSerializer, SessionSerializer


class SessionViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Compute sessions. Users see their own, staff all; another user's session is a 404."""

    serializer_class = SessionSerializer
    lookup_url_kwarg = "session_id"

    def get_queryset(self):
        sessions = session_list_for(user=self.request.user)
        wanted = self.request.query_params.get("status")
        return sessions.filter(status__in=wanted.upper().split(",")) if wanted else sessions

    def get_object(self):
        return session_get_for(user=self.request.user, session_id=self.kwargs["session_id"])

    def create(self, request):
        """`{"name", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}, "command"}` → 201 PENDING."""
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = services.session_create(owner=request.user, **data.validated_data)
        return Response(SessionSerializer(session_get_for(user=request.user, session_id=session.pk)).data,
                        status=status.HTTP_201_CREATED)

    def retrieve(self, request, session_id=None):
        return Response(SessionSerializer(self.get_object()).data)

    def destroy(self, request, session_id=None):
        """Terminate: 202 with the session (TERMINATING, or CANCELLED if it was still pending)."""
        session = services.session_terminate(session=self.get_object())
        return Response(SessionSerializer(session_get_for(user=request.user, session_id=session.pk)).data,
                        status=status.HTTP_202_ACCEPTED)

    @action(detail=False, methods=["post"])
    def preview(self, request):
        """What this request would get now (same body as create); nothing is created."""
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(launch_preview(resources=data.validated_data["resources"]))

    @action(detail=True, methods=["post"], url_path="terminal-ticket")
    def terminal_ticket(self, request, session_id=None):
        """A one-time ticket for the terminal websocket: `{"ticket", "url", "expires_at"}`."""
        session = self.get_object()
        ticket, row = services.terminal_ticket_create(session=session, user=request.user)
        return Response({"ticket": ticket, "url": f"/ws/sessions/{session.pk}/terminal/?ticket={ticket}",
                         "expires_at": row.expires_at})


@api_view(["GET"])
def launch_options_view(request):
    """What the launch dialog may offer now (see sessions.launch.launch_options)."""
    return Response(launch_options(user=request.user))
