"""REST API for projects, quotas and the caller's quota usage (`/api/v1/`).

Administrators create and change projects and quotas (ETag / If-Match, `common.api_support`);
a user reads the projects they belong to and the quotas that apply to them (their own and
their projects'), and `GET /api/v1/quota/` tells them what those quotas allow and what is in
use (counting rules: `sessions.policy.quotas`). Amounts: fGPU as decimal text, memory in bytes.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Q
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers, viewsets
from rest_framework.decorators import api_view
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response

from accelerators.models import ResourceGroup
from common.api_support import ErrorSerializer, ETagMixin, IsAdminOrReadOnly, TextFilter, admin_write_docs
from sessions.scheduling.fairshare import account_shares
from sessions.models import Project, Quota
from sessions.policy.quotas import quota_report


class ProjectSerializer(serializers.ModelSerializer):
    members = serializers.SlugRelatedField(
        many=True, required=False, slug_field="username", queryset=get_user_model().objects.all(), help_text="usernames"
    )
    resource_groups = serializers.SlugRelatedField(
        many=True,
        required=False,
        slug_field="name",
        queryset=ResourceGroup.objects.all(),
        help_text="names of the resource groups reserved for the members of the projects naming them (a group no "
        "project names is open to everyone; `sessions.policy.group_access`)",
    )

    class Meta:
        model = Project
        fields = ["id", "name", "description", "members", "resource_groups", "share_weight", "created_at"]
        read_only_fields = ["id", "created_at"]


class QuotaSerializer(serializers.ModelSerializer):
    user = serializers.SlugRelatedField(
        slug_field="username",
        queryset=get_user_model().objects.all(),
        required=False,
        allow_null=True,
        help_text="the user this quota limits (or project)",
    )
    project = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Project.objects.all(),
        required=False,
        allow_null=True,
        help_text="the project this quota limits (or user)",
    )
    scope = serializers.SerializerMethodField(help_text='"user" or "project"')

    class Meta:
        model = Quota
        fields = [
            "id",
            "scope",
            "user",
            "project",
            "max_fgpu",
            "max_devices",
            "max_gpu_memory",
            "max_sessions",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]
        extra_kwargs = {"max_fgpu": {"min_value": 0}, "max_gpu_memory": {"min_value": 0}}

    def get_scope(self, quota) -> str:
        return "project" if quota.project_id is not None else "user"

    def validate(self, attrs):
        """The model's constraints (one of user / project; one quota per subject), checked
        before saving so they answer 400 with the model's messages, not a database error."""
        candidate = (
            Quota(**{f.attname: getattr(self.instance, f.attname) for f in Quota._meta.concrete_fields})
            if self.instance is not None
            else Quota()
        )
        if self.instance is not None:
            candidate._state.adding = False
        for key, value in attrs.items():
            setattr(candidate, key, value)
        try:
            candidate.validate_constraints()
        except DjangoValidationError as exc:
            raise serializers.ValidationError(serializers.as_serializer_error(exc)) from None
        return attrs


def _visible_to(user):
    if user.is_staff:
        return Q()
    return Q(user=user) | Q(project__in=user.projects.all())


@extend_schema_view(
    **admin_write_docs(
        "project",
        tags=["quotas"],
        examples=[
            OpenApiExample(
                "A team sharing one quota",
                value={"name": "vision", "description": "computer vision team", "members": ["alice", "bob"]},
            ),
            OpenApiExample(
                "A team with a resource group of its own",
                value={"name": "training", "members": ["carol"], "resource_groups": ["a100-pool"]},
            ),
        ],
        patch_examples=[
            OpenApiExample("Change the members", value={"members": ["alice", "bob", "carol"]}),
        ],
    )
)
class ProjectViewSet(ETagMixin, viewsets.ModelViewSet):
    """Projects (groups of users sharing a quota). Users see the projects they belong to."""

    serializer_class = ProjectSerializer
    permission_classes = [IsAdminOrReadOnly]

    def get_queryset(self):
        projects = Project.objects.prefetch_related("members", "resource_groups")
        if getattr(self, "swagger_fake_view", False):
            return projects.none()
        user = self.request.user
        if not user.is_authenticated:  # the permission lets none in; the type checker learns it is a User
            return projects.none()
        return projects if user.is_staff else projects.filter(members=user)


class QuotaFilter(filters.FilterSet):
    user = TextFilter(field_name="user__username", help_text="username")
    project = TextFilter(field_name="project__name", help_text="project name")

    class Meta:
        model = Quota
        fields = ["user", "project"]


@extend_schema_view(
    **admin_write_docs(
        "quota",
        tags=["quotas"],
        examples=[
            OpenApiExample(
                "A user's quota",
                value={"user": "alice", "max_fgpu": "2.000", "max_devices": 2, "max_gpu_memory": 16 << 30, "max_sessions": 4},
            ),
            OpenApiExample("A project's quota, fGPU only", value={"project": "vision", "max_fgpu": "8.000"}),
        ],
        patch_examples=[
            OpenApiExample("Lift the session limit", value={"max_sessions": None}),
            OpenApiExample("Raise the fGPU limit", value={"max_fgpu": "4.000"}),
        ],
    )
)
class QuotaViewSet(ETagMixin, viewsets.ModelViewSet):
    """Quotas per user or project; a limit left null is unlimited. Users see the quotas that apply
    to them (their own and their projects')."""

    serializer_class = QuotaSerializer
    permission_classes = [IsAdminOrReadOnly]
    filterset_class = QuotaFilter

    def get_queryset(self):
        quotas = Quota.objects.select_related("user", "project")
        if getattr(self, "swagger_fake_view", False):
            return quotas.none()
        return quotas.filter(_visible_to(self.request.user))


# --- the caller's usage -----------------------------------------------------------------------


class QuotaFiguresSerializer(serializers.Serializer):
    fgpu = serializers.CharField(allow_null=True, help_text="fGPU, decimal text; null: unlimited")
    devices = serializers.IntegerField(allow_null=True, help_text="distinct devices; null: unlimited")
    gpu_memory = serializers.IntegerField(allow_null=True, help_text="bytes of device memory; null: unlimited")
    sessions = serializers.IntegerField(allow_null=True, help_text="sessions running or waiting; null: unlimited")


class QuotaUsageSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    scope = serializers.CharField(help_text='"user" or "project"')
    name = serializers.CharField(help_text="the username or project name")
    limits = QuotaFiguresSerializer()
    used = QuotaFiguresSerializer(help_text="held now, pending sessions counted as what they asked")
    remaining = QuotaFiguresSerializer()


class MyQuotaSerializer(serializers.Serializer):
    user = serializers.CharField()
    quotas = QuotaUsageSerializer(many=True, help_text="each quota that applies: the user's own, then projects' by name")
    headroom = QuotaFiguresSerializer(help_text="the smallest remaining allowance over those quotas")


@extend_schema(
    summary="Your quota usage",
    tags=["quotas"],
    responses={
        200: MyQuotaSerializer,
        404: OpenApiResponse(ErrorSerializer, description="administrators' `?user=`: no such user"),
    },
    description="What the quotas that apply to you allow, what is in use and what is left; `headroom` is the "
    "smallest remaining allowance (null: unlimited). No quota: an empty list, everything unlimited.",
    parameters=[OpenApiParameter("user", OpenApiTypes.STR, description="administrators: another user's username")],
)
@api_view(["GET"])
def quota_view(request):
    """The caller's quotas, usage and headroom; administrators may name another user (`?user=`)."""
    user = request.user
    wanted = request.query_params.get("user")
    if wanted and wanted != user.get_username():
        if not user.is_staff:
            raise PermissionDenied("Only administrators may look at another user's quota.")
        user = get_user_model().objects.filter(username=wanted).first()
        if user is None:
            raise NotFound(f"no user {wanted!r}")
    return Response(MyQuotaSerializer(quota_report(user=user)).data)


# --- fair share -----------------------------------------------------------------------------------


class AccountShareSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(["project", "user"], help_text="a project, or a user in no project")
    name = serializers.CharField(help_text="the project's name or the user's username")
    weight = serializers.IntegerField(help_text="the project's share_weight (1 for a user in no project)")
    usage_fgpu_hours = serializers.FloatField(
        help_text="fGPU-hours granted to its members, each hour weighted by 2^(-age / half-life)"
    )
    usage_share = serializers.FloatField(help_text="its part of all active accounts' decayed usage, 0–1")
    weight_share = serializers.FloatField(help_text="its part of all active accounts' weights, 0–1")
    factor = serializers.FloatField(help_text="2^(-usage_share / weight_share), 0–1: higher starts first")
    pending = serializers.IntegerField(help_text="its members' sessions waiting now")


class FairShareSerializer(serializers.Serializer):
    half_life_days = serializers.IntegerField(help_text="FGPU_FAIRSHARE_HALF_LIFE_DAYS; 0: fair share is off")
    accounts = AccountShareSerializer(many=True)


@extend_schema(
    summary="Fair share",
    tags=["quotas"],
    responses={200: FairShareSerializer},
    examples=[
        OpenApiExample(
            "Two projects",
            response_only=True,
            value={
                "half_life_days": 7,
                "accounts": [
                    {
                        "kind": "project",
                        "name": "vision",
                        "weight": 1,
                        "usage_fgpu_hours": 30.5,
                        "usage_share": 0.9,
                        "weight_share": 0.5,
                        "factor": 0.287,
                        "pending": 4,
                    },
                    {
                        "kind": "project",
                        "name": "nlp",
                        "weight": 1,
                        "usage_fgpu_hours": 3.4,
                        "usage_share": 0.1,
                        "weight_share": 0.5,
                        "factor": 0.871,
                        "pending": 1,
                    },
                ],
            },
        )
    ],
    description="Each active account's (every project, and every user in no project, with usage or a waiting "
    "session) decayed usage, weight and fair-share factor, lowest factor first (sessions.scheduling.fairshare). "
    "Within a priority the queue starts the sessions of the account with the higher factor first. "
    "Administrators see every account, others the accounts they belong to.",
)
@api_view(["GET"])
def fairshare_view(request):
    """`{"half_life_days", "accounts": [{kind, name, weight, usage_fgpu_hours, usage_share, weight_share, factor,
    pending}]}`."""
    shares = account_shares()
    if not request.user.is_staff:
        shares = [a for a in shares if request.user.pk in a.members]
    return Response(
        FairShareSerializer(
            {
                "half_life_days": settings.FGPU_FAIRSHARE_HALF_LIFE_DAYS,
                "accounts": [
                    {
                        "kind": a.kind,
                        "name": a.name,
                        "weight": a.weight,
                        "usage_fgpu_hours": round(a.usage / 3600, 6),
                        "usage_share": round(a.usage_share, 6),
                        "weight_share": round(a.weight_share, 6),
                        "factor": round(a.factor, 6),
                        "pending": a.pending,
                    }
                    for a in shares
                ],
            }
        ).data
    )
