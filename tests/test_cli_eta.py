"""`fgpu` says a band as the session page and the API do (issue 32.3, 32.4): `fgpu launch
--dry-run` says when the request would start, and `fgpu describe` never shows "now" beside
"Fits now: no" (a session waiting for sessions due to end now starts "any moment")."""
from __future__ import annotations

import pytest
from django.utils import timezone

from accounts.services import login_token_issue
from fgpu_cli import main as cli
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import session_report_apply
from sessions.admission.launch import session_create
from tests.test_eta import WHOLE


def running(owner, *, minutes_ago: float) -> ComputeSession:
    """A session of `owner` holding the whole GPU, RUNNING since `minutes_ago` (a launch through
    the live console may be placed at its commit already: the pass then finds nothing to do)."""
    session = session_create(owner=owner, name="holder", resources=WHOLE)
    schedule_pending()
    assert ComputeSession.objects.get(pk=session.pk).status == SessionStatus.SCHEDULED
    session_report_apply(session_id=str(session.pk), status=SessionStatus.RUNNING)
    ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timezone.timedelta(minutes=minutes_ago))
    return ComputeSession.objects.get(pk=session.pk)


@pytest.fixture
def fgpu(live_server, demo_cluster, alice, monkeypatch, tmp_path):
    """`fgpu(*args)` runs the CLI as alice against the live console (its output: capsys); the
    demo node's nodes are in no group, with a maximum lifetime of 2 h."""
    from usage.models import IdlePolicy

    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", live_server.url)
    monkeypatch.setenv("FGPU_TOKEN", login_token_issue(user=alice))
    return lambda *args: cli.main(list(args))


def test_a_dry_run_of_a_request_that_would_wait_says_when_it_would_start(fgpu, bob, capsys):
    running(bob, minutes_ago=30)  # the whole GPU, 90 min left of its lifetime

    assert fgpu("launch", "--fgpu", "2", "--mem", "64M", "--dry-run") == 0
    out = capsys.readouterr().out

    assert "Fits now:        no" in out, out
    assert "Would start:" in out and "UTC (in 1h" in out, out
    assert "Place in queue:  1" in out, out
    assert not ComputeSession.objects.filter(status=SessionStatus.PENDING).exists()


def test_describe_says_any_moment_not_now_for_a_session_that_does_not_fit_now(fgpu, alice, bob, capsys):
    holder = running(bob, minutes_ago=30)
    mine = session_create(owner=alice, name="mine", resources={"cuda.shares": "2", "mem": "64M"})
    ComputeSession.objects.filter(pk=holder.pk).update(  # its lifetime ran out a minute ago: due to end now
        started_at=timezone.now() - timezone.timedelta(hours=2, minutes=1), version=holder.version + 1
    )

    assert fgpu("describe", str(mine.pk)) == 0
    out = capsys.readouterr().out

    assert "Fits now:             no" in out, out
    (start,) = [line for line in out.splitlines() if line.startswith("Estimated start:")]
    assert start.endswith("UTC (any moment)") and "now" not in start, out
    assert "expected to do now" in out, out
