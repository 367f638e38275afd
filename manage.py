#!/usr/bin/env python
"""Django's command-line utility for fGPU Console."""

import os
import sys


def main() -> None:
    # `manage.py standalone` is the embedded single-machine mode of DESIGN.md: it selects its
    # own settings module (SQLite, in-memory channel layer, eager Celery) before Django loads.
    if len(sys.argv) > 1 and sys.argv[1] == "standalone":
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings_standalone")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
