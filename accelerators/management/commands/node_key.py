"""`python manage.py node_key NODE`: a new key for NODE's agent to sign its messages with."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from accelerators.services import node_agent_key_rotate


class Command(BaseCommand):
    help = (
        "Make a new agent key for a node (the old one stops working) and print the agent.toml line that "
        "uses it. Keep it out of sessions' reach: readable by the agent's user only."
    )

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name (agent.toml [agent] id)")

    def handle(self, *args, node: str, **options):
        key = node_agent_key_rotate(node_name=node)
        self.stdout.write(f'[manager]\nnode-key = "{key}"')
