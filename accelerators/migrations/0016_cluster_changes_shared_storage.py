"""The cluster change log's node trigger (0013, 0014) watches `shared_storage` too (issue 37.3), so the
kept cluster view reloads a node whose agent registers with another `[storage] shared`, and the
allocator's storage scope sees it as soon as the registration commits (PostgreSQL only; on SQLite
the view reads the database each time)."""

import importlib

from django.db import migrations

_drain = importlib.import_module("accelerators.migrations.0014_node_drain")
_COLUMNS = [*_drain._COLUMNS, "drain_since"]


class Migration(migrations.Migration):
    dependencies = [("accelerators", "0015_node_shared_storage")]

    operations = [migrations.RunPython(_drain._replace([*_COLUMNS, "shared_storage"]), _drain._replace(_COLUMNS))]
