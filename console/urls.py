from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from accelerators import api as accelerator_api
from accelerators import api_drain, api_fleet, api_mig
from accounts import api as account_api
from accounts import views as account_views
from sessions.api import sessions as session_api
from sessions.api import eta as api_eta
from sessions.api import files as api_files
from sessions.api import shares as api_shares
from sessions.api import fragmentation as api_fragmentation
from sessions.api import images as api_images
from sessions.api import presets as api_presets
from sessions.api import quotas as api_quotas
from sessions.api import resources as api_resources
from sessions import views
from usage import api as usage_api
from usage import metrics as usage_metrics

# Every app's admin module, loaded here, by the web only (console.settings: SimpleAdminConfig, as
# Django's admin documentation describes for a project that discovers its admin modules itself).
admin.autodiscover()

router = DefaultRouter()
router.register("sessions", session_api.SessionViewSet, basename="api-session")
router.register("nodes", accelerator_api.NodeViewSet, basename="api-node")
router.register("devices", accelerator_api.DeviceViewSet, basename="api-device")
router.register("slot-formats", accelerator_api.SlotFormatViewSet, basename="api-slot-format")
router.register("fractional-settings", accelerator_api.FractionalSettingsViewSet, basename="api-fractional-settings")
router.register("resource-groups", accelerator_api.ResourceGroupViewSet, basename="api-resource-group")
router.register("projects", api_quotas.ProjectViewSet, basename="api-project")
router.register("quotas", api_quotas.QuotaViewSet, basename="api-quota")
router.register("images", api_images.SessionImageViewSet, basename="api-image")
router.register("presets", api_presets.ResourcePresetViewSet, basename="api-preset")
router.register("mig/profiles", api_mig.MigProfileViewSet, basename="api-mig-profile")
router.register("mig/layouts", api_mig.MigLayoutViewSet, basename="api-mig-layout")

# The error JSON under /api/, Django's pages elsewhere.
handler400 = "common.api_support.bad_request"
handler404 = "common.api_support.not_found"
handler500 = "common.api_support.server_error"

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", account_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("sessions/", views.session_list, name="session-list"),
    path("sessions/<uuid:session_id>/terminal/", views.session_terminal, name="session-terminal"),
    path("sessions/<uuid:session_id>/open/<slug:app>/", views.session_app_open, name="session-app-open"),
    path("account/", include("accounts.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/auth/token/", account_api.obtain_auth_token, name="api-token"),
    path("api/v1/launch-options/", session_api.launch_options_view, name="api-launch-options"),
    path("api/v1/quota/", api_quotas.quota_view, name="api-quota-usage"),
    path("api/v1/fairshare/", api_quotas.fairshare_view, name="api-fairshare"),
    path("api/v1/fragmentation/", api_fragmentation.fragmentation_view, name="api-fragmentation"),
    path("api/v1/fragmentation/apply/", api_fragmentation.fragmentation_apply_view, name="api-fragmentation-apply"),
    path("api/v1/fleet/", api_fleet.fleet_view, name="api-fleet"),
    path("api/v1/my-resources/", api_resources.my_resources_view, name="api-my-resources"),
    path("api/v1/me/", account_api.me_view, name="api-me"),
    path("api/v1/usage/", usage_api.usage_view, name="api-usage"),
    path("api/v1/sessions/<uuid:session_id>/usage/", usage_api.session_usage_view, name="api-session-usage"),
    path("api/v1/sessions/<uuid:session_id>/eta/", api_eta.session_eta_view, name="api-session-eta"),
    path("api/v1/scheduler/what-if/", api_eta.what_if_view, name="api-scheduler-what-if"),
    path("api/v1/shares/", api_shares.shares_view, name="api-shares"),
    path("api/v1/shares/<uuid:share_id>/", api_shares.share_view, name="api-share"),
    path("api/v1/sessions/<uuid:session_id>/files/", api_files.files_view, name="api-session-files"),
    path("api/v1/sessions/<uuid:session_id>/files/content/", api_files.file_content_view, name="api-session-file-content"),
    path("api/v1/usage/latest/", usage_api.latest_usage_view, name="api-usage-latest"),
    re_path(
        rf"^api/v1/nodes/(?P<name>{accelerator_api.NodeViewSet.lookup_value_regex})/usage/$",
        usage_api.node_usage_view,
        name="api-node-usage",
    ),
    re_path(
        rf"^api/v1/nodes/(?P<name>{accelerator_api.NodeViewSet.lookup_value_regex})/processes/$",
        usage_api.node_processes_view,
        name="api-node-processes",
    ),
    re_path(
        rf"^api/v1/nodes/(?P<name>{accelerator_api.NodeViewSet.lookup_value_regex})/mark-dead/$",
        accelerator_api.node_mark_dead_view,
        name="api-node-mark-dead",
    ),
    re_path(
        rf"^api/v1/nodes/(?P<name>{accelerator_api.NodeViewSet.lookup_value_regex})/drain/$",
        api_drain.node_drain_view,
        name="api-node-drain",
    ),
    re_path(
        rf"^api/v1/nodes/(?P<name>{accelerator_api.NodeViewSet.lookup_value_regex})/undrain/$",
        api_drain.node_undrain_view,
        name="api-node-undrain",
    ),
    path("metrics", usage_metrics.metrics_view, name="metrics"),
    re_path(
        rf"^api/v1/nodes/(?P<name>{api_mig.NodeMigViewSet.lookup_value_regex})/mig/$",
        api_mig.NodeMigViewSet.as_view({"get": "retrieve", "put": "update", "patch": "partial_update"}),
        name="api-node-mig",
    ),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/v1/", include(router.urls)),
]
