"""The cluster's change log (issue 35.1): the node each write to the placement's inputs touched,
logged by triggers in the writer's own transaction, for the kept cluster view
(`accelerators.cluster_view`) to bring itself up to date from what changed.

PostgreSQL only: the table `accelerators_clusterchange` (`id`, `node_id` — NULL: "reload
everything", for a resource group's change —, `txid` the writer's transaction id as `xid8`,
`at`) and statement-level triggers (one row per node a statement touched) on nodes (the fields
placement reads, not heartbeats), devices, device links, resource groups, allocations and
sessions (status, node, CPU, memory). Triggers rather than calls in the services: every writer
is covered, `QuerySet.update()`, the admin and a bulk write included, and a writer cannot
forget. On SQLite (standalone: a handful of nodes) nothing is made: the view reads the
database each time there."""

from django.db import migrations

# table → (the node id of a row, the columns whose change matters; None: any change)
WATCHED = {
    "accelerators_node": (
        "r.id",
        [
            "name",
            "status",
            "cpu_count",
            "memory_size",
            "images",
            "attributes",
            "resource_group_id",
            "device_split_count",
            "memory_scaling",
            "core_scaling",
            "mig_mode",
        ],
    ),
    "accelerators_device": ("r.node_id", None),
    "accelerators_devicelink": ("r.node_id", None),
    "compute_sessions_allocation": ("(SELECT d.node_id FROM accelerators_device d WHERE d.id = r.device_id)", None),
    "compute_sessions_computesession": ("r.node_id", ["status", "node_id", "cpu", "mem"]),
}


def _sql(table: str, node: str, columns: list[str] | None) -> list[str]:
    changed = " OR ".join(f"o.{c} IS DISTINCT FROM n.{c}" for c in columns) if columns else "TRUE"
    old_node, new_node = node.replace("r.", "o."), node.replace("r.", "n.")
    function = f"fgpu_cluster_change_{table}"
    return [
        f"""
        CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO accelerators_clusterchange (node_id)
                SELECT DISTINCT {node} FROM new_rows r WHERE {node} IS NOT NULL;
            ELSIF TG_OP = 'DELETE' THEN
                INSERT INTO accelerators_clusterchange (node_id)
                SELECT DISTINCT {node} FROM old_rows r WHERE {node} IS NOT NULL;
            ELSE
                INSERT INTO accelerators_clusterchange (node_id)
                SELECT DISTINCT x FROM (
                    SELECT {old_node} AS x FROM old_rows o JOIN new_rows n ON o.id = n.id WHERE {changed}
                    UNION
                    SELECT {new_node} FROM old_rows o JOIN new_rows n ON o.id = n.id WHERE {changed}
                ) touched WHERE x IS NOT NULL;
            END IF;
            RETURN NULL;
        END $$;
        """,
        f"CREATE TRIGGER {table}_change_i AFTER INSERT ON {table} REFERENCING NEW TABLE AS new_rows "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        f"CREATE TRIGGER {table}_change_u AFTER UPDATE ON {table} REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        f"CREATE TRIGGER {table}_change_d AFTER DELETE ON {table} REFERENCING OLD TABLE AS old_rows "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
    ]


FORWARD = [
    """
    CREATE TABLE accelerators_clusterchange (
        id bigserial PRIMARY KEY,
        node_id uuid NULL,
        txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
        at timestamptz NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX accelerators_clusterchange_txid ON accelerators_clusterchange (txid)",
    """
    CREATE FUNCTION fgpu_cluster_change_everything() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO accelerators_clusterchange (node_id) VALUES (NULL);
        RETURN NULL;
    END $$
    """,
    "CREATE TRIGGER accelerators_resourcegroup_change AFTER INSERT OR UPDATE OR DELETE ON accelerators_resourcegroup "
    "FOR EACH STATEMENT EXECUTE FUNCTION fgpu_cluster_change_everything()",
    *(statement for table, (node, columns) in WATCHED.items() for statement in _sql(table, node, columns)),
]

BACKWARD = [
    *(f"DROP TRIGGER IF EXISTS {table}_change_{op} ON {table}" for table in WATCHED for op in "iud"),
    *(f"DROP FUNCTION IF EXISTS fgpu_cluster_change_{table}()" for table in WATCHED),
    "DROP TRIGGER IF EXISTS accelerators_resourcegroup_change ON accelerators_resourcegroup",
    "DROP FUNCTION IF EXISTS fgpu_cluster_change_everything()",
    "DROP TABLE IF EXISTS accelerators_clusterchange",
]


def _run(statements: list[str]):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in statements:
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("accelerators", "0012_admin_verbose_names"),
        ("compute_sessions", "0015_host_image_description"),
    ]

    operations = [migrations.RunPython(_run(FORWARD), _run(BACKWARD), elidable=False)]
