"""ASGI entry point: `uvicorn console.asgi:application` (daphne serves it too).

HTTP goes to Django (static files served by Django's ASGI static handler) behind the upload
guard (console.upload_guard: a body is refused before it is read, 401/413), an upload's body read
by its view as it arrives (common.request_body), except
`/sessions/<id>/apps/<name>/…`, which the app proxy hands on to the apps origin with a one-time
ticket (sessions.serving.proxy.ConsoleAppRedirect); websockets go through the origin check, then
session-cookie auth, then the URL router (Channels' docs); a message sent to a websocket whose
client has gone is dropped. In front of it all, requests to the apps origin (FGPU_APPS_ORIGIN,
told apart by their `Host`) go to the app proxy alone, and those the apps origin's pages send to
the console are refused (sessions.serving.proxy.OriginRouter).
"""

import logging
import os
from importlib import import_module

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402


class _ASGIHandler(ASGIHandler):
    """Django's ASGI handler sending a response's body in pieces of up to 1 MiB, not 64 KiB: each
    piece is one trip through the server's HTTP/1.1 writer (uvicorn's h11, pure Python), and a
    download streamed at hundreds of MB/s (the files API) spent most of the web's time there."""

    chunk_size = 1 << 20


django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application
django_asgi_app = _ASGIHandler()

from common.secret_key import require_secret_key  # noqa: E402

require_secret_key("web")  # no SECRET_KEY of its own (FGPU_SECRET_KEY; standalone keeps one): exit 2, saying why

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import OriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from common.startup import freeze_imported_objects  # noqa: E402
from common.request_body import StreamedBody  # noqa: E402
from console.upload_guard import UploadGuard, is_upload  # noqa: E402
from sessions.serving.proxy import AppProxyRouter, AppWebsocketProxy, ConsoleAppRedirect, OriginRouter  # noqa: E402
from sessions.routing import websocket_urlpatterns  # noqa: E402


class BrowserOriginValidator(OriginValidator):
    """Channels' origin check against ALLOWED_HOSTS, except that a connection with no Origin
    header is let through: browsers always send one on websockets, so a missing Origin means a
    non-browser client (CLI, script), which cross-site hijacking cannot involve. Terminals
    still need a one-time ticket, which only an authenticated API call can obtain."""

    def valid_origin(self, parsed_origin) -> bool:
        if parsed_origin is None:
            return True
        return super().valid_origin(parsed_origin)


class GoneClientSendsDropped:
    """ASGI middleware: a websocket's sends after its client has gone are dropped, as daphne
    drops them; uvicorn raises ClientDisconnected (an OSError) instead, which would end the
    consumer with an error before the disconnect that is on its way reaches it. The server's
    own `send` stays reachable as `real_send` (sessions.consumers.server_transport)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, _DroppingSend(send).send)


class _DroppingSend:
    def __init__(self, real_send):
        self.real_send = real_send

    async def send(self, message) -> None:
        try:
            await self.real_send(message)
        except OSError:
            pass


application = OriginRouter(
    ProtocolTypeRouter(
        {
            "http": AppProxyRouter(
                ConsoleAppRedirect(), UploadGuard(StreamedBody(ASGIStaticFilesHandler(django_asgi_app), streamed=is_upload))
            ),
            "websocket": GoneClientSendsDropped(
                BrowserOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)), settings.ALLOWED_HOSTS)
            ),
        }
    ),
    apps_websocket=GoneClientSendsDropped(AppWebsocketProxy()),
)
if settings.FGPU_APPS_ORIGIN:
    logging.getLogger("fgpu.web").info("session apps are served on %s (FGPU_APPS_ORIGIN) only", settings.FGPU_APPS_ORIGIN)
else:
    logging.getLogger("fgpu.web").warning(
        "session apps are off: FGPU_APPS_ORIGIN is not set (an origin of their own, e.g. http://apps.example.org: README)"
    )

import_module(settings.ROOT_URLCONF)  # the views and what they import, loaded now rather than at the first request
if not getattr(settings, "STANDALONE", False):  # standalone freezes once it serves and its agents have started
    freeze_imported_objects("web")
