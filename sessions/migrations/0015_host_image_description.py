"""The built-in "host" image's description says what the process runtime does since issue 31 (a
sandbox per session, as an unprivileged user), where an install still has 0007's words (sessions
ran as the agent's user). A description an administrator changed is left as it is."""

from django.db import migrations

OLD = "The node's own system: the process runtime runs sessions as processes of the agent's user, without a container."
NEW = (
    "The node's own system, without a container: the process runtime runs each session in its own sandbox "
    "(bubblewrap), as an unprivileged user, the system read-only."
)


def describe_sandbox(apps, schema_editor):
    SessionImage = apps.get_model("compute_sessions", "SessionImage")
    SessionImage.objects.filter(reference="host", description=OLD).update(description=NEW)


def describe_old(apps, schema_editor):
    SessionImage = apps.get_model("compute_sessions", "SessionImage")
    SessionImage.objects.filter(reference="host", description=NEW).update(description=OLD)


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0014_session_preempt_signal_requeue"),
    ]

    operations = [migrations.RunPython(describe_sandbox, describe_old)]
