"""`manage.py standalone` restarts keep browsers signed in (issue 18): the admin password from
FGPU_ADMIN_PASSWORD is written only when it differs, since Django ties a login session to the
password hash (a new hash, even of the same password, signs every browser out). A restart
(issue 35.4) checks that password only once the console serves, and skips `migrate` while every
migration is applied."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder

from console.management.commands.standalone import Command, migrations_all_applied

pytestmark = pytest.mark.django_db


def ensure_admin(monkeypatch, password: str) -> str:
    """What the start says of user admin, its deferred password check run (as `_serve` runs it)."""
    monkeypatch.setenv("FGPU_ADMIN_PASSWORD", password)
    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    check = command._ensure_admin()
    if check is not None:
        check()
    return command.stdout.getvalue()


def test_a_restart_with_the_same_password_keeps_the_hash_and_so_every_login(monkeypatch):
    assert "Created user admin" in ensure_admin(monkeypatch, "admin-pass-123")
    admin = get_user_model().objects.get(username="admin")
    session_hash = admin.get_session_auth_hash()
    assert ensure_admin(monkeypatch, "admin-pass-123") == ""
    admin.refresh_from_db()
    assert admin.get_session_auth_hash() == session_hash


def test_a_restart_with_a_new_password_changes_it(monkeypatch):
    ensure_admin(monkeypatch, "admin-pass-123")
    assert "Changed the password" in ensure_admin(monkeypatch, "another-pass-456")
    admin = get_user_model().objects.get(username="admin")
    assert admin.check_password("another-pass-456") and not admin.check_password("admin-pass-123")


def test_a_restart_leaves_the_password_check_until_the_console_serves(monkeypatch):
    """The check hashes the password (PBKDF2): the start hands it to `_serve` rather than making
    the first page wait for it; the password changes only when it runs."""
    ensure_admin(monkeypatch, "admin-pass-123")
    monkeypatch.setenv("FGPU_ADMIN_PASSWORD", "another-pass-456")
    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    check = command._ensure_admin()
    admin = get_user_model().objects.get(username="admin")
    assert check is not None and admin.check_password("admin-pass-123")
    check()
    admin.refresh_from_db()
    assert admin.check_password("another-pass-456")
    monkeypatch.delenv("FGPU_ADMIN_PASSWORD")
    assert command._ensure_admin() is None  # no password set: nothing to check


def test_a_restart_skips_migrate_only_while_every_migration_on_disk_is_applied():
    """`migrations_all_applied` is what `migrate` would find: nothing to do on the migrated test
    database; a migration not recorded (a new one, as after a pull) makes it migrate."""
    assert migrations_all_applied()
    recorder = MigrationRecorder(connection)
    app, name = sorted(recorder.applied_migrations())[-1]
    recorder.record_unapplied(app, name)
    assert not migrations_all_applied()
