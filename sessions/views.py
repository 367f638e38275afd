"""Pages: the session list with its launch dialog, and the terminal page. Thin views."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render

from sessions.api_images import SessionImageSerializer
from sessions.images import image_default
from sessions.launch import launch_options
from sessions.models import SessionImage
from sessions.selectors import session_get_for, session_list_for
from sessions.serializers import SessionSerializer


@login_required
def home(request):
    return redirect("session-list")


@login_required
def session_list(request):
    sessions = SessionSerializer(session_list_for(user=request.user)[:200], many=True).data
    images = SessionImageSerializer(SessionImage.objects.all(), many=True, context={}).data  # as GET /api/v1/images/
    default = image_default()
    return render(request, "sessions/session_list.html", {
        "sessions": sessions, "launch_options": launch_options(user=request.user), "images": images,
        "default_image": default.reference if default else ""})


@login_required
def session_terminal(request, session_id):
    session = session_get_for(user=request.user, session_id=session_id)
    return render(request, "sessions/terminal.html", {"session": SessionSerializer(session).data})
