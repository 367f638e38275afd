"""A node's drain (issue 37.4): `drain_since` (NULL: in service), `drain_evict`, `drain_reason`
and `drain_by` on accelerators_node, and the cluster change log's node trigger (0013) watching
`drain_since` too, so the kept cluster view leaves a draining node out as soon as the drain
commits (PostgreSQL only; on SQLite the view reads the database each time)."""

import importlib

from django.db import migrations, models

_log = importlib.import_module("accelerators.migrations.0013_cluster_changes")
_TABLE = "accelerators_node"
_NODE, _COLUMNS = _log.WATCHED[_TABLE]


def _function(columns: list[str]) -> str:
    return _log._sql(_TABLE, _NODE, columns)[0].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _replace(columns: list[str]):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(_function(columns))

    return run


class Migration(migrations.Migration):
    dependencies = [("accelerators", "0013_cluster_changes")]

    operations = [
        migrations.AddField(
            model_name="node",
            name="drain_since",
            field=models.DateTimeField(
                blank=True,
                editable=False,
                help_text="set while an administrator drains the node (accelerators.drain.node_drain): no new session "
                "is placed on it; empty: in service",
                null=True,
                verbose_name="draining since",
            ),
        ),
        migrations.AddField(
            model_name="node",
            name="drain_evict",
            field=models.BooleanField(
                default=False,
                editable=False,
                help_text="the drain evicts: its running sessions get the preemption notice and grace, then are "
                "stopped and requeued; off: they run to their end",
                verbose_name="evict on drain",
            ),
        ),
        migrations.AddField(
            model_name="node",
            name="drain_reason",
            field=models.CharField(blank=True, editable=False, max_length=200, verbose_name="drain reason"),
        ),
        migrations.AddField(
            model_name="node",
            name="drain_by",
            field=models.CharField(blank=True, editable=False, max_length=150, verbose_name="drained by"),
        ),
        migrations.RunPython(_replace([*_COLUMNS, "drain_since"]), _replace(_COLUMNS)),
    ]
