from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("accelerators", "0014_node_drain")]

    operations = [
        migrations.AddField(
            model_name="node",
            name="shared_storage",
            field=models.BooleanField(
                default=False,
                editable=False,
                help_text="its agent's data-root is a shared mount (NFS, CephFS, …) every node saying so mounts alike "
                "(agent.toml [storage] shared, reported at registration); false: the node's own disk, so the data "
                "folders its sessions see are local to it",
            ),
        ),
    ]
