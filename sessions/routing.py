from django.urls import path

from sessions import consumers

websocket_urlpatterns = [
    path("ws/sessions/", consumers.SessionEventsConsumer.as_asgi()),
    path("ws/sessions/<uuid:session_id>/terminal/", consumers.TerminalConsumer.as_asgi()),
]
