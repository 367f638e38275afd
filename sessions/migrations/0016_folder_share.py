"""Data folders shared with users and projects (issue 36.5): sessions.models.FolderShare."""

import django.db.models.deletion
import uuid
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0015_host_image_description"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="FolderShare",
            fields=[
                ("id", models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ("permission", models.CharField(choices=[("ro", "read-only"), ("rw", "read-write")], default="ro", max_length=2)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "created_by",
                    models.ForeignKey(
                        null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="+", to=settings.AUTH_USER_MODEL
                    ),
                ),
                (
                    "owner",
                    models.ForeignKey(
                        blank=True,
                        help_text="whose ~/data is shared (or null: a project's folder)",
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="folder_shares_out",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "project",
                    models.ForeignKey(
                        blank=True,
                        help_text="whose project folder is shared (or null: a user's ~/data)",
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="folder_shares_out",
                        to="compute_sessions.project",
                    ),
                ),
                (
                    "to_project",
                    models.ForeignKey(
                        blank=True,
                        help_text="the project whose members it is shared with (or null: a user)",
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="folder_shares_in",
                        to="compute_sessions.project",
                    ),
                ),
                (
                    "user",
                    models.ForeignKey(
                        blank=True,
                        help_text="the user it is shared with (or null: a project)",
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="folder_shares_in",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["created_at"],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("owner__isnull", False), ("project__isnull", True)),
                            models.Q(("owner__isnull", True), ("project__isnull", False)),
                            _connector="OR",
                        ),
                        name="folder_share_one_folder",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("to_project__isnull", True), ("user__isnull", False)),
                            models.Q(("to_project__isnull", False), ("user__isnull", True)),
                            _connector="OR",
                        ),
                        name="folder_share_one_grantee",
                    ),
                    models.UniqueConstraint(
                        fields=("owner", "project", "user", "to_project"), name="folder_share_unique", nulls_distinct=False
                    ),
                ],
            },
        ),
    ]
