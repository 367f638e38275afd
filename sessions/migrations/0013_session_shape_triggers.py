"""Triggers that rewrite a session's row (an UPDATE that changes no value: a new row version, so a
new `xmin`) whenever a row its API shape is made from changes, so the session list's kept shapes
(sessions.shapes) are keyed by the session row's `xmin` alone. PostgreSQL only; nothing on
another database (which keeps no shapes).

What a shape is made from (SessionSerializer): the session's row (its own xmin), its allocations
and GPU instances (any write), their devices (the fields shown), its node (name, attributes,
MIG mode; not the heartbeat's columns), its image (any field) and its owner's username. The
slot formats are read with each page instead (sessions.shapes)."""

from django.db import migrations

SESSION = "compute_sessions_computesession"
TOUCH = f"UPDATE {SESSION} SET version = version WHERE id IN"

FUNCTIONS = {
    # statement-level, with transition tables: one UPDATE per statement, whatever its rows
    "fgpu_shape_allocation_inserted": f"{TOUCH} (SELECT session_id FROM new_rows)",
    "fgpu_shape_allocation_updated": f"{TOUCH} (SELECT session_id FROM old_rows UNION SELECT session_id FROM new_rows)",
    "fgpu_shape_allocation_deleted": f"{TOUCH} (SELECT session_id FROM old_rows)",
    # row-level, each behind a WHEN that lets only the shown fields' changes through
    "fgpu_shape_gpuinstance_changed": f"{TOUCH} (OLD.session_id, NEW.session_id)",
    "fgpu_shape_gpuinstance_deleted": f"{TOUCH} (OLD.session_id)",
    "fgpu_shape_device_changed": (
        f"{TOUCH} (SELECT session_id FROM compute_sessions_allocation WHERE device_id = NEW.id"
        " UNION SELECT session_id FROM accelerators_gpuinstance WHERE parent_id = NEW.id)"
    ),
    "fgpu_shape_node_changed": f"UPDATE {SESSION} SET version = version WHERE node_id = NEW.id",
    "fgpu_shape_image_changed": f"UPDATE {SESSION} SET version = version WHERE image_id = NEW.id",
    "fgpu_shape_owner_changed": f"UPDATE {SESSION} SET version = version WHERE owner_id = NEW.id",
}

DEVICE_SHOWN = ("device_id", "index", "model_name", "memory_size", "subproc_count", "is_mig_device", "mig_profile")
INSTANCE_SHOWN = (
    "session_id", "parent_id", "profile", "placement_start", "placement_size", "memory_size", "subproc_count", "uuid",
)


def _changed(columns) -> str:
    return " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in columns)


TRIGGERS = [
    "CREATE TRIGGER fgpu_shape_allocation_inserted AFTER INSERT ON compute_sessions_allocation "
    "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION fgpu_shape_allocation_inserted()",
    "CREATE TRIGGER fgpu_shape_allocation_updated AFTER UPDATE ON compute_sessions_allocation "
    "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION fgpu_shape_allocation_updated()",
    "CREATE TRIGGER fgpu_shape_allocation_deleted AFTER DELETE ON compute_sessions_allocation "
    "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION fgpu_shape_allocation_deleted()",
    "CREATE TRIGGER fgpu_shape_gpuinstance_inserted AFTER INSERT ON accelerators_gpuinstance "
    "FOR EACH ROW WHEN (NEW.session_id IS NOT NULL) EXECUTE FUNCTION fgpu_shape_gpuinstance_changed()",
    "CREATE TRIGGER fgpu_shape_gpuinstance_updated AFTER UPDATE ON accelerators_gpuinstance "
    f"FOR EACH ROW WHEN ({_changed(INSTANCE_SHOWN)}) EXECUTE FUNCTION fgpu_shape_gpuinstance_changed()",
    "CREATE TRIGGER fgpu_shape_gpuinstance_deleted AFTER DELETE ON accelerators_gpuinstance "
    "FOR EACH ROW WHEN (OLD.session_id IS NOT NULL) EXECUTE FUNCTION fgpu_shape_gpuinstance_deleted()",
    "CREATE TRIGGER fgpu_shape_device_changed AFTER UPDATE ON accelerators_device "
    f"FOR EACH ROW WHEN ({_changed(DEVICE_SHOWN)}) EXECUTE FUNCTION fgpu_shape_device_changed()",
    "CREATE TRIGGER fgpu_shape_node_changed AFTER UPDATE ON accelerators_node "
    f"FOR EACH ROW WHEN ({_changed(('name', 'attributes', 'mig_mode'))}) EXECUTE FUNCTION fgpu_shape_node_changed()",
    "CREATE TRIGGER fgpu_shape_image_changed AFTER UPDATE ON compute_sessions_sessionimage "
    "FOR EACH ROW WHEN (OLD.* IS DISTINCT FROM NEW.*) EXECUTE FUNCTION fgpu_shape_image_changed()",
    "CREATE TRIGGER fgpu_shape_owner_changed AFTER UPDATE ON auth_user "
    f"FOR EACH ROW WHEN ({_changed(('username',))}) EXECUTE FUNCTION fgpu_shape_owner_changed()",
]


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, body in FUNCTIONS.items():
        schema_editor.execute(
            f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {body}; RETURN NULL; END $$"
        )
    for trigger in TRIGGERS:
        schema_editor.execute(trigger)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for trigger in TRIGGERS:
        name, table = trigger.split()[2], trigger.split(" ON ")[1].split()[0]
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
    for name in FUNCTIONS:
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {name}()")


class Migration(migrations.Migration):
    dependencies = [
        ("compute_sessions", "0012_session_preemption"),
        ("accelerators", "0012_admin_verbose_names"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(create, drop, elidable=False)]
