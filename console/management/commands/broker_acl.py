"""`python manage.py broker_acl NODE [NODE …] --acl-file users.acl`: the broker's Redis ACL users,
one per role (common/broker_acl.py), and the URL each process is given."""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from common.broker_acl import MANAGER, WEB, acl_file as acl_text, agent_user, broker_users


class Command(BaseCommand):
    help = (
        "Write a Redis ACL file with a user for the web, the manager and each node's agent (new random "
        "passwords), and print the broker URL each process gets."
    )

    def add_arguments(self, parser):
        parser.add_argument("nodes", nargs="+", help="the agents' node names (agent.toml [agent] id)")
        parser.add_argument("--acl-file", required=True, help="where to write the ACL file (mode 600)")
        parser.add_argument("--broker-url", default="", help="the broker's address (default: $REDIS_URL)")

    def handle(self, *args, nodes: list[str], acl_file: str, broker_url: str, **options):
        broker_url = broker_url or settings.REDIS_URL or ""
        if not broker_url.startswith(("redis://", "rediss://")):
            raise CommandError("--broker-url: a redis:// or rediss:// URL is needed (or set REDIS_URL)")
        try:
            users = broker_users(nodes)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        path = Path(acl_file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(acl_text(users))
        by_name = {u.name: u for u in users}
        self.stdout.write(
            f"wrote {path} ({len(users)} users; the default user is off). Load it with "
            f"`redis-server --aclfile {path.resolve()}` (or `ACL LOAD`).\n"
        )
        self.stdout.write(f"web:                     REDIS_URL={by_name[WEB].url(broker_url)}")
        self.stdout.write(f"manager (worker, beat):  REDIS_URL={by_name[MANAGER].url(broker_url)}")
        for node in nodes:
            self.stdout.write(f'agent {node}: agent.toml [manager] broker-url = "{by_name[agent_user(node)].url(broker_url)}"')
