"""`python manage.py import_accelerator_config FILE [--node NAME]`.

FILE is a Backend.AI mock-accelerator TOML (slot formats; with --node also the node's device
inventory) or the etcd-style JSON of fractional settings. Prints a summary on stdout and each
warning on stderr as `warning: …`. A file that cannot be imported exits with status 1 and
the file, field and problem; nothing is imported then.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accelerators.config_import import ConfigError, import_accelerator_config


class Command(BaseCommand):
    help = (
        "Import a Backend.AI mock-accelerator TOML (slot formats, and with --node the node's devices) "
        'or an etcd-style JSON of fractional settings ({"config": {"plugins": {"accelerator": {...}}}}).'
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="path to a .toml (mock accelerator) or .json (etcd-style settings) file")
        parser.add_argument(
            "--node",
            metavar="NAME",
            default=None,
            help="TOML only: register or update node NAME with the file's devices (replaces its inventory)",
        )

    def handle(self, *args, **options) -> None:
        try:
            report = import_accelerator_config(options["file"], node_name=options["node"])
        except ConfigError as exc:
            raise CommandError(f"{exc} (nothing imported)") from exc
        for warning in report.warnings:
            self.stderr.write(f"warning: {warning}")
        self.stdout.write(report.summary())
