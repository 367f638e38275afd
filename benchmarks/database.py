"""A database of its own for one benchmark run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def throwaway_database(prefix: str) -> Iterator[str]:
    """A fresh, migrated database named `<prefix>_<name>` beside the one DATABASE_URL names
    (Django's test-database machinery; an old one of that name is replaced), Django's default
    connection pointed at it; dropped at the end (stop every process using it first). Yields
    its name. Call after `django.setup()`."""
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"{prefix}_{old_name}"  # not pytest's test_<name>
    name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        yield name
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
