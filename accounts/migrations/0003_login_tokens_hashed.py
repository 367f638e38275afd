"""Login tokens stored hashed (issue 31.7): they become ApiToken rows of kind "login" (SHA-256
digest and prefix, as named tokens), and DRF authtoken's plaintext keys are moved over (hashed,
so every `fgpu login` keeps working) and deleted from its table."""

import hashlib

from django.db import migrations, models


def hash_login_tokens(apps, schema_editor):
    Token = apps.get_model("authtoken", "Token")
    ApiToken = apps.get_model("accounts", "ApiToken")
    for token in Token.objects.all().iterator():
        row = ApiToken.objects.create(
            user_id=token.user_id,
            name="fgpu login",
            kind="login",
            digest=hashlib.sha256(token.key.encode()).hexdigest(),
            prefix=token.key[:8],
        )
        ApiToken.objects.filter(pk=row.pk).update(created_at=token.created)
    Token.objects.all().delete()


class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0002_login_token_proxy"),
        ("authtoken", "0004_alter_tokenproxy_options"),
    ]

    operations = [
        migrations.DeleteModel(name="LoginToken"),
        migrations.AddField(
            model_name="apitoken",
            name="kind",
            field=models.CharField(
                choices=[("named", "named API token"), ("login", "login token (fgpu login)")],
                default="named",
                editable=False,
                max_length=8,
            ),
        ),
        migrations.RemoveConstraint(model_name="apitoken", name="accounts_apitoken_unique_live_name"),
        migrations.AddConstraint(
            model_name="apitoken",
            constraint=models.UniqueConstraint(
                condition=models.Q(("kind", "named"), ("revoked_at__isnull", True)),
                fields=("user", "name"),
                name="accounts_apitoken_unique_live_name",
            ),
        ),
        migrations.CreateModel(
            name="LoginToken",
            fields=[],
            options={
                "verbose_name": "login token (fgpu login)",
                "verbose_name_plural": "login tokens (fgpu login)",
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("accounts.apitoken",),
        ),
        migrations.RunPython(hash_login_tokens, migrations.RunPython.noop),
    ]
