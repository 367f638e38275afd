"""The admin's side of a node's drain (issue 37.4; `accelerators.drain`): the node list's "drain"
column and its actions (drain, drain and evict, undrain), and the node page's "Drain" part with
its buttons. `NodeAdmin` (accelerators.admin) mixes this in."""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html

from accelerators.admin_display import EMPTY, when_html
from accelerators.drain import MAX_REASON_CHARS, drain_state, node_drain, node_drain_state, node_undrain, nodes_sessions_left
from accelerators.models import Node

DRAIN_ACTIONS = ("drain", "drain_evict", "undrain")


class NodeDrainAdminMixin:
    """Drain column, actions and node-page buttons for `admin.ModelAdmin[Node]`."""

    def drain_urls(self) -> list:
        view = self.admin_site.admin_view(self.drain_view)  # type: ignore[attr-defined]
        return [path("<path:object_id>/drain/<str:verb>/", view, name="accelerators_node_drain")]

    def drain_annotate(self, nodes: list[Node]) -> None:
        """Give the list's draining nodes their sessions left (one query, none when none drains)."""
        draining = [n.pk for n in nodes if n.drain_since is not None]
        left = nodes_sessions_left(draining) if draining else {}
        for node in nodes:
            node._drain_left = left.get(node.pk, 0)  # type: ignore[attr-defined]  # read by drain_column

    @admin.display(description="drain")
    def drain_column(self, obj: Node) -> str:
        """ "draining: 2 sessions left" or "drained" (with its reason as a tooltip); — in service."""
        if obj.drain_since is None:
            return EMPTY
        state = drain_state(obj, getattr(obj, "_drain_left", 0))
        evict = " (evicting)" if state.evict and state.sessions_left else ""
        return format_html(
            "<span class='node-drain' title='{}'>{}{}</span>", state.reason or "no reason given", state.label, evict
        )

    @admin.display(description="state")
    def drain_control(self, obj: Node) -> str:
        """The node page's drain part: its state, and buttons that post the page's form (and its
        CSRF token) to `drain_view`: Drain (a reason, evict or not) or Undrain."""
        if not obj.pk:
            return "—"
        state = node_drain_state(obj)
        url = reverse("admin:accelerators_node_drain", kwargs={"object_id": obj.pk, "verb": "drain"})
        if obj.drain_since is None:
            return format_html(
                "<p>In service: new sessions may be placed here.</p>"
                # No <label>: the admin's fieldsets set every label in a 160-px column (aligned forms).
                "<p><input type='text' id='id_drain_reason' name='drain_reason' maxlength='{}' size='50' "
                "aria-label='Reason for the drain' placeholder='reason (shown with the state)'></p>"
                "<p><input type='checkbox' id='id_drain_evict' name='drain_evict' value='1' "
                "aria-labelledby='drain-evict-text'> <span id='drain-evict-text'>evict running sessions: each gets the "
                "preemption notice and grace, then is requeued on another node</span></p>"
                "<p><button type='submit' class='button' formaction='{}' formnovalidate>Drain</button> "
                "no new session is placed on this node; running ones go on unless evicted.</p>",
                MAX_REASON_CHARS,
                url,
            )
        undrain = reverse("admin:accelerators_node_drain", kwargs={"object_id": obj.pk, "verb": "undrain"})
        by = f" by {state.by}" if state.by else ""
        why = f": {state.reason}" if state.reason else " (no reason given)"
        evict = (
            "Its running sessions get the preemption notice and grace, then are requeued elsewhere."
            if state.evict
            else "Its running sessions go on to their end."
        )
        return format_html(
            "<p><strong class='node-drain'>{}</strong>. Drained{} since {}{}. {}</p>"
            "<p><button type='submit' class='button' formaction='{}' formnovalidate>Undrain</button> "
            "back in service: new sessions may be placed here again.</p>",
            state.label,
            by,
            when_html(state.since),
            why,
            evict,
            undrain,
        )

    def drain_view(self, request: HttpRequest, object_id: str, verb: str) -> HttpResponseRedirect | HttpResponseNotAllowed:
        """POST from the node page's buttons: drain (`drain_reason`, `drain_evict`) or undrain, then
        back to the node page with a message. Needs the change permission."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        node = self.get_object(request, object_id)  # type: ignore[attr-defined]
        if node is None or verb not in ("drain", "undrain") or not self.has_change_permission(request, node):  # type: ignore[attr-defined]
            raise PermissionDenied
        who = request.user.get_username()
        if verb == "drain":
            reason = request.POST.get("drain_reason", "").strip()[:MAX_REASON_CHARS]
            _, state = node_drain(node_name=node.name, evict=request.POST.get("drain_evict") == "1", reason=reason, by=who)
        else:
            _, state = node_undrain(node_name=node.name, by=who)
        self.message_user(request, f"Node {node.name}: {state.label}")  # type: ignore[attr-defined]
        return HttpResponseRedirect(reverse("admin:accelerators_node_change", args=[node.pk]))

    def _drain_all(self, request: HttpRequest, queryset: QuerySet[Node], *, evict: bool) -> None:
        for node in queryset.order_by("name"):
            _, state = node_drain(node_name=node.name, evict=evict, by=request.user.get_username())
            self.message_user(request, f"Node {node.name}: {state.label}")  # type: ignore[attr-defined]

    @admin.action(description="Drain: place no new session there, let running ones finish", permissions=["change"])
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._drain_all(request, queryset, evict=False)

    @admin.action(
        description="Drain and evict: running sessions get the preemption notice and grace, then are requeued",
        permissions=["change"],
    )
    def drain_evict(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._drain_all(request, queryset, evict=True)

    @admin.action(description="Undrain: back in service", permissions=["change"])
    def undrain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        for node in queryset.order_by("name"):
            _, state = node_undrain(node_name=node.name, by=request.user.get_username())
            self.message_user(request, f"Node {node.name}: {state.label}")  # type: ignore[attr-defined]
