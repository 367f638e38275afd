"""A trigger that rewrites a session's row (an UPDATE that changes no value: a new `xmin`) when its
reclamation warning (`SessionActivity.deadline`, `reason`) is given, changed or withdrawn, so the
session list's kept shapes (sessions.api.shapes), which show it since issue 36.3 (`deadline`,
`deadline_reason`), are never stale. Not for the activity's other columns (`last_input`,
`last_sample` move with every usage batch: they are not shown). PostgreSQL only, as
compute_sessions 0013's triggers."""

from django.db import migrations

SESSION = "compute_sessions_computesession"
ACTIVITY = "usage_sessionactivity"
FUNCTION = "fgpu_shape_activity_changed"
WARNING = ("deadline", "reason")


def _changed(columns) -> str:
    return " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in columns)


TRIGGERS = {
    "fgpu_shape_activity_inserted": f"AFTER INSERT ON {ACTIVITY} FOR EACH ROW WHEN (NEW.deadline IS NOT NULL)",
    "fgpu_shape_activity_updated": f"AFTER UPDATE ON {ACTIVITY} FOR EACH ROW WHEN ({_changed(WARNING)})",
    "fgpu_shape_activity_deleted": f"AFTER DELETE ON {ACTIVITY} FOR EACH ROW WHEN (OLD.deadline IS NOT NULL)",
}


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"UPDATE {SESSION} SET version = version WHERE id IN (OLD.session_id, NEW.session_id); RETURN NULL; END $$"
    )
    for name, when in TRIGGERS.items():
        schema_editor.execute(f"CREATE TRIGGER {name} {when} EXECUTE FUNCTION {FUNCTION}()")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in TRIGGERS:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {name} ON {ACTIVITY}")
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0013_session_shape_triggers"),
        ("usage", "0003_storage_use"),
    ]

    operations = [migrations.RunPython(create, drop)]
