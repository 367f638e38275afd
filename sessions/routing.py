from django.urls import path, re_path

from sessions import consumers
from sessions.app_proxy import AppWebsocketProxy

websocket_urlpatterns = [
    path("ws/sessions/", consumers.SessionEventsConsumer.as_asgi()),
    path("ws/sessions/<uuid:session_id>/terminal/", consumers.TerminalConsumer.as_asgi()),
    path("ws/sessions/<uuid:session_id>/open/<slug:app>/", consumers.AppOpenConsumer.as_asgi()),
    # django-stubs type re_path's view as a Django view; Channels' URLRouter takes ASGI apps.
    re_path(r"^sessions/[0-9a-f-]{36}/apps/[a-z][a-z0-9-]{0,31}/", AppWebsocketProxy()),  # type: ignore[arg-type]  # the app proxy's
]
