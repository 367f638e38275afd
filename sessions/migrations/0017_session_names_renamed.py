"""Sessions launched before 0018 may share a name while not ended: all but the earliest of each
such group of an owner's are renamed, "<name>-2", "<name>-3", … (the first suffix none of that
owner's sessions has), so 0018's constraint (issue 36.6: a user's sessions not ended have
distinct names) can be made."""

from django.db import migrations, models

ENDED = ["TERMINATED", "ERROR", "CANCELLED"]
MAX_NAME = 64


def rename_live_duplicates(apps, schema_editor):
    """Give every live session sharing its owner's live name with an earlier one a free name."""
    sessions = apps.get_model("compute_sessions", "ComputeSession")
    live = sessions.objects.exclude(status__in=ENDED)
    groups = live.values("owner_id", "name").annotate(n=models.Count("id")).filter(n__gt=1)
    for group in groups.iterator():
        owner, name = group["owner_id"], group["name"]
        taken = set(sessions.objects.filter(owner_id=owner).values_list("name", flat=True))
        later = live.filter(owner_id=owner, name=name).order_by("created_at", "id")[1:]
        for session in later:
            n = 2
            while True:
                suffix = f"-{n}"
                candidate = name[: MAX_NAME - len(suffix)] + suffix
                if candidate not in taken:
                    break
                n += 1
            taken.add(candidate)
            sessions.objects.filter(pk=session.pk).update(name=candidate)


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0016_folder_share"),
    ]

    operations = [
        migrations.RunPython(rename_live_duplicates, migrations.RunPython.noop),
    ]
