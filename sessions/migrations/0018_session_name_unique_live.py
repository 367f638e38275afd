"""A user's sessions not ended have distinct names (issue 36.6): a partial unique index on
(owner, name) over the sessions not TERMINATED, ERROR or CANCELLED (Backend.AI's
ix_sessions_unique_name_nonterminal, per user). Its own migration, after 0017's renames: on
PostgreSQL an index is not made in the transaction that updated the table's rows."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0017_session_names_renamed"),
    ]

    operations = [
        migrations.AddConstraint(
            model_name="computesession",
            constraint=models.UniqueConstraint(
                condition=models.Q(("status__in", ["TERMINATED", "ERROR", "CANCELLED"]), _negated=True),
                fields=("owner", "name"),
                name="session_name_unique_live",
                violation_error_message="you have a session of this name that has not ended",
            ),
        ),
    ]
