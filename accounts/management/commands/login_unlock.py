"""`manage.py login_unlock --user NAME … --address IP …`: clear login throttle locks."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from accounts import throttle


class Command(BaseCommand):
    help = "Clear the login throttle's locks: a user's (from every address) and an address's (accounts.throttle)."

    def add_arguments(self, parser):
        parser.add_argument("--user", action="append", default=[], metavar="NAME", help="a username (repeatable)")
        parser.add_argument("--address", action="append", default=[], metavar="IP", help="a client address (repeatable)")

    def handle(self, *args, user: list[str], address: list[str], **options):
        if not user and not address:
            raise CommandError("name at least one --user or --address")
        for name in user:
            throttle.login_failures_clear_user(username=name)
            self.stdout.write(f"cleared the failed logins of user {name}")
        for ip in address:
            throttle.login_failures_clear_address(ip=ip)
            self.stdout.write(f"cleared the failed logins from address {ip}")
