"""Pages: the session list with its launch dialog, and the terminal page. Thin views."""

from __future__ import annotations

import re

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render

from accelerators.models import Node
from common.errors import ApplicationError
from sessions.api.sessions import NODE_PATTERN, OWNER_PATTERN
from sessions.api.images import SessionImageSerializer
from sessions.policy.images import image_default
from sessions.admission.launch import launch_options
from sessions.admission.resources import my_resources
from sessions.models import ACTIVE_STATUSES, FINAL_STATUSES, ComputeSession, SessionImage, SessionStatus
from sessions.selectors import session_get_for, session_list_for
from sessions.api.serializers import SessionSerializer, session_shape
from sessions.admission.launch import session_default_name
from sessions.serving.session_apps import session_app_get

# The list's tabs and the statuses each shows (static/js/sessions.js asks the API for the same).
TABS = {
    "all": tuple(SessionStatus.values),
    "running": (SessionStatus.PENDING, *ACTIVE_STATUSES),
    "finished": FINAL_STATUSES,
}
LIST_TABS = [("all", "All"), ("running", "Running"), ("finished", "Finished")]
PAGE_SIZE = 25  # rows per page of the list
MAX_PAGE = 10**6


@login_required
def home(request):
    return redirect("session-list")


def list_filters(request) -> dict:
    """The list's place from the page's query string — `?tab=all|running|finished&status=&owner=
    &node=&page=` — as the page's script keeps it: `{"tab", "status", "owner", "node", "page"}`.
    What is not valid is left out (a status outside the tab, an owner for a non-administrator,
    a malformed name or page), never an error: the page opens on what it can show."""
    query = request.GET
    tab = query.get("tab") if query.get("tab") in TABS else "all"
    status = query.get("status", "").upper()
    owner, node, page = query.get("owner", ""), query.get("node", ""), query.get("page", "")
    return {
        "tab": tab,
        "status": status if status in TABS[tab] else "",
        "owner": owner if request.user.is_staff and len(owner) <= 150 and re.fullmatch(OWNER_PATTERN, owner) else "",
        "node": node if len(node) <= 128 and re.fullmatch(NODE_PATTERN, node) else "",
        "page": min(int(page), MAX_PAGE) if page.isdigit() and 0 < len(page) <= 7 and int(page) > 0 else 1,
    }


def _sessions_shown(user, filters: dict):
    sessions = session_list_for(user=user).filter(status__in=[filters["status"]] if filters["status"] else TABS[filters["tab"]])
    if filters["owner"]:
        sessions = sessions.filter(owner__username=filters["owner"])
    if filters["node"]:
        sessions = sessions.filter(node__name=filters["node"])
    return sessions


@login_required
def session_list(request):
    filters = list_filters(request)
    shown = _sessions_shown(request.user, filters)
    count = shown.count()
    filters["page"] = min(filters["page"], max(1, -(-count // PAGE_SIZE)))  # past the last page: the last
    start = (filters["page"] - 1) * PAGE_SIZE
    sessions = SessionSerializer(shown[start : start + PAGE_SIZE], many=True).data
    images = SessionImageSerializer(SessionImage.objects.all(), many=True, context={}).data  # as GET /api/v1/images/
    default = image_default()
    owners = (
        sorted(ComputeSession.objects.order_by().values_list("owner__username", flat=True).distinct())
        if request.user.is_staff
        else []
    )
    return render(
        request,
        "sessions/session_list.html",
        {
            "sessions": sessions,
            "launch_options": launch_options(user=request.user),
            "images": images,
            "my_resources": my_resources(user=request.user),
            "default_image": default.reference if default else "",
            "list_state": {
                "filters": filters,
                "count": count,
                "page_size": PAGE_SIZE,
                "show_owner": request.user.is_staff,
                "owners": owners,
                "nodes": list(Node.objects.order_by("name").values_list("name", flat=True)),
                "default_name": session_default_name(owner=request.user),
            },
            "show_owner": request.user.is_staff,
            "filters": filters,
            "list_tabs": LIST_TABS,
            "count": count,
            "first": start + 1 if count else 0,
            "last": start + len(sessions),
        },
    )


@login_required
def session_terminal(request, session_id):
    session = session_get_for(user=request.user, session_id=session_id)
    return render(request, "sessions/terminal.html", {"session": session_shape(session)})


@login_required
def session_app_open(request, session_id, app):
    """The page that starts a session app and then opens it (static/js/app_open.js follows the
    start over `/ws/sessions/<id>/open/<app>/`). 404 for a session the user may not see or an app
    its image does not declare."""
    session = session_get_for(user=request.user, session_id=session_id)
    try:
        found = session_app_get(session=session, name=app)
    except ApplicationError:
        raise Http404("no such app") from None
    return render(request, "sessions/app_open.html", {"session": session, "app": found, "status": session.status})
