from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from rest_framework.authtoken.views import obtain_auth_token
from rest_framework.routers import DefaultRouter

from accelerators.api import NodeViewSet
from sessions import api as session_api
from sessions import views

router = DefaultRouter()
router.register("sessions", session_api.SessionViewSet, basename="api-session")
router.register("nodes", NodeViewSet, basename="api-node")

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("sessions/", views.session_list, name="session-list"),
    path("sessions/<uuid:session_id>/terminal/", views.session_terminal, name="session-terminal"),
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", obtain_auth_token, name="api-token"),
    path("api/v1/launch-options/", session_api.launch_options_view, name="api-launch-options"),
    path("api/v1/", include(router.urls)),
]
