"""`manage.py standalone` restarts keep browsers signed in (issue 18): the admin password from
FGPU_ADMIN_PASSWORD is written only when it differs, since Django ties a login session to the
password hash (a new hash, even of the same password, signs every browser out)."""
from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model

from console.management.commands.standalone import Command

pytestmark = pytest.mark.django_db


def ensure_admin(monkeypatch, password: str) -> str:
    monkeypatch.setenv("FGPU_ADMIN_PASSWORD", password)
    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    command._ensure_admin()
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
