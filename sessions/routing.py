from django.urls import path

from sessions import consumers

websocket_urlpatterns = [
    path("ws/sessions/", consumers.SessionEventsConsumer.as_asgi()),
    path("ws/sessions/<uuid:session_id>/terminal/", consumers.TerminalConsumer.as_asgi()),
    path("ws/sessions/<uuid:session_id>/open/<slug:app>/", consumers.AppOpenConsumer.as_asgi()),
    # The app proxy's websockets are the apps origin's alone (sessions.serving.proxy.OriginRouter).
]
