"""What if I launched this now? (issue 32.4): the launch preview answers when the request would
start, as a band — the same band the session's own ETA gives once it is launched — and the
session page, the API and the CLI word a band the same way ("now" only beside "fits now")."""
from __future__ import annotations

from datetime import timedelta

from accelerators.allocation import replay as pure
from fgpu_cli.formatting import eta_start
from sessions.scheduling import eta
from sessions.models import ComputeSession, SessionStatus
from sessions.admission.launch import session_create
from tests.conftest import client_for
from tests.test_eta import WHOLE, close, one_gpu, running  # noqa: F401 (fixture)

PREVIEW = "/api/v1/sessions/preview/"


def test_a_request_that_would_wait_is_given_the_band_its_session_then_gets(one_gpu, alice, bob):  # noqa: F811
    holder = running(bob, minutes_ago=30)
    body = {"name": "later", "resources": WHOLE}

    answer = client_for(alice).post(PREVIEW, body, format="json")

    assert answer.status_code == 200, answer.content
    preview = answer.json()
    assert preview["outcome"] == "waits" and not preview["fits_now"]
    band = preview["eta"]
    assert band["outcome"] == "estimate" and band["position"] == 1
    end = holder.started_at + timedelta(hours=2)  # nodes in no group: a lifetime of 2 h
    assert close(eta.as_datetime(_epoch(band["earliest"])), end) and close(eta.as_datetime(_epoch(band["latest"])), end)
    assert not ComputeSession.objects.filter(owner=alice).exists()  # nothing was created

    launched = session_create(owner=alice, name="later", resources=WHOLE)
    own = eta.session_eta(session=launched)
    assert own.outcome == band["outcome"] and own.position == band["position"]
    assert close(own.earliest, eta.as_datetime(_epoch(band["earliest"])))


def test_a_request_that_fits_starts_now_and_one_too_large_never(one_gpu, alice):  # noqa: F811
    client = client_for(alice)

    fits = client.post(PREVIEW, {"resources": {"cuda.shares": "1", "mem": "64M"}}, format="json").json()
    huge = client.post(PREVIEW, {"resources": {"cuda.shares": "4", "mem": "64M"}}, format="json").json()

    assert fits["fits_now"] and fits["eta"]["outcome"] == "now" and fits["eta"]["position"] == 1
    assert huge["outcome"] == "refused" and huge["eta"]["outcome"] == "never" and huge["eta"]["reason"]


def test_a_band_due_now_for_a_session_that_does_not_fit_says_why_and_never_bare_now():
    due = pure.Band(1000.0, 1600.0, pure.PLACED)
    agreed = eta.band_agreed(due, fits_now=False, after=[], now=1000.0)

    assert agreed.reason == eta.DUE
    assert eta.band_outcome(agreed, 1000.0, fits_now=False) == "estimate"
    assert eta.band_outcome(pure.Band(1000.0, 1000.0, pure.PLACED), 1000.0, fits_now=False) == "estimate"
    assert eta.band_outcome(pure.Band(1000.0, 1000.0, pure.PLACED), 1000.0, fits_now=True) == "now"
    text = eta_start({"outcome": "estimate", "earliest": "2020-01-01T00:00:00Z", "latest": "2020-01-01T00:10:00Z",
                      "fits_now": False})
    assert "any moment" in text and "(now" not in text


def test_no_band_but_known_ends_of_what_holds_its_room_give_its_earliest_start(db, alice):
    holder = ComputeSession(owner=alice, name="x")
    after = [eta.FitsAfter(holder, "n1", eta.End(2000.0, 2600.0, "maximum lifetime of 1 h"))]

    agreed = eta.band_agreed(pure.Band(None, None, pure.WAITING, "the queue ahead"), fits_now=False, after=after,
                             now=1000.0)

    assert (agreed.earliest, agreed.latest, agreed.outcome) == (2000.0, None, pure.PLACED)
    assert "the latest start is unknown" in agreed.reason
    assert eta.band_outcome(agreed, 1000.0, fits_now=False) == "estimate"


def test_a_waiting_sessions_reasons_name_no_other_users_session(one_gpu, alice, bob, settings):  # noqa: F811
    settings.FGPU_BACKFILL_LIMIT = 0
    running(bob, minutes_ago=30)
    session_create(owner=bob, name="bobs-secret-job", resources=WHOLE)
    mine = session_create(owner=alice, name="mine", resources={"cuda.shares": "1", "mem": "64M"})
    ComputeSession.objects.filter(pk=mine.pk).update(created_at=mine.created_at + timedelta(seconds=1))

    answer = client_for(alice).get(f"/api/v1/sessions/{mine.pk}/eta/").json()

    assert "bobs-secret-job" not in str(answer)
    assert ComputeSession.objects.get(pk=mine.pk).status == SessionStatus.PENDING


def _epoch(text: str) -> float:
    from django.utils.dateparse import parse_datetime

    moment = parse_datetime(text)
    assert moment is not None
    return moment.timestamp()
