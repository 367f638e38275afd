from django.db import migrations, models


class Migration(migrations.Migration):
    """ComputeSession.version: raised by every write a page shows, so pages and clients keep the
    newest of two states that reach them out of order (notices from two processes, an API answer)."""

    dependencies = [
        ("compute_sessions", "0007_session_images"),
    ]

    operations = [
        migrations.AddField(
            model_name="computesession",
            name="version",
            field=models.PositiveBigIntegerField(
                default=0, help_text="raised by every write a page shows (status, reason, node, times): the newest "
                                     "state has the highest"),
        ),
    ]
