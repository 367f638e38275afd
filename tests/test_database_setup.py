"""The in-process tests run in the test database, not the one DATABASE_URL names: a PostgreSQL
connection pool opened while collecting (tests/test_openapi.py reads the schema through WSGI at
import) once kept serving the real database after pytest-django's switch (tests/conftest.py,
django_db_modify_db_settings), and end-to-end stacks, given the test database, found it empty."""
from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db


def test_in_process_queries_reach_the_test_database():
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database()" if connection.vendor == "postgresql" else "SELECT 'n/a'")
        current = cursor.fetchone()[0]
    assert name.startswith("test_") and (connection.vendor != "postgresql" or current == name), (name, current)
