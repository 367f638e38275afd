"""A user's sessions that have not ended have distinct names (issue 36.6; Backend.AI's rule,
its partial unique index ix_sessions_unique_name_nonterminal, per user): the API and its
preview answer 400 "name-taken" naming the field, `fgpu launch` says so, two launches at once
with one name on real PostgreSQL give one session, and an ended session's name may be used
again. The launch dialog's side: tests/test_browser_launch_styles.py."""
from __future__ import annotations

import pytest
from django.db import connection

from accounts.services import login_token_issue
from fgpu_cli import main as cli
from sessions.admission import launch as admission
from sessions.lifecycle import services
from sessions.models import ComputeSession, SessionStatus
from sessions.selectors import session_name_unused
from tests.conftest import assert_error_shape, client_for
from tests.races import race

HALF = {"cuda.shares": "0.5"}


def launch(client, name: str):
    return client.post("/api/v1/sessions/", {"name": name, "resources": HALF}, format="json")


@pytest.mark.django_db
def test_a_second_live_session_of_one_name_is_a_400_naming_the_field_and_the_first(demo_cluster, alice, bob):
    api = client_for(alice)
    assert launch(api, "train").status_code == 201

    body = assert_error_shape(launch(api, " train "), 400)  # the name as launched: stripped
    assert body["type"] == "name-taken" and body["title"] == "Name in use"
    assert body["field_errors"]["name"] == [
        "you already have a session named 'train' that has not ended (PENDING): choose another name, or end that "
        "session first (an ended session's name may be used again)"
    ]
    assert ComputeSession.objects.filter(owner=alice, name="train").count() == 1
    # Another user's names are theirs; a different name is free.
    assert launch(client_for(bob), "train").status_code == 201
    assert launch(api, "train-2").status_code == 201


@pytest.mark.django_db
def test_the_preview_says_a_taken_name_is_refused_and_a_blank_name_passes(demo_cluster, alice):
    api = client_for(alice)
    assert launch(api, "train").status_code == 201
    refused = api.post("/api/v1/sessions/preview/", {"name": "train", "resources": HALF}, format="json").json()
    assert (refused["outcome"], refused["refusal"]) == ("refused", "name-taken")
    assert refused["name_error"].startswith("you already have a session named 'train' that has not ended (")
    for name in ("", "other"):
        answer = api.post("/api/v1/sessions/preview/", {"name": name, "resources": HALF}, format="json")
        assert answer.status_code == 200, answer.content
        assert answer.json()["name_error"] == "" and answer.json()["refusal"] == ""


@pytest.mark.django_db
def test_an_ended_sessions_name_may_be_used_again(demo_cluster, alice):
    api = client_for(alice)
    first = launch(api, "train").json()
    services.session_terminate(session=ComputeSession.objects.get(pk=first["id"]), reason="test")
    assert ComputeSession.objects.get(pk=first["id"]).status == SessionStatus.CANCELLED

    again = launch(api, "train")
    assert again.status_code == 201, again.content
    assert ComputeSession.objects.filter(owner=alice, name="train").count() == 2
    # The database holds the rule, whoever writes: a second live row of the name is refused there.
    with pytest.raises(Exception, match="session_name_unique_live|UNIQUE constraint"):
        ComputeSession.objects.create(owner=alice, name="train", resources=HALF)


@pytest.mark.django_db
def test_a_session_made_for_the_user_takes_a_free_variant_of_a_taken_name(demo_cluster, alice):
    """What a preempted session launched again is named where its owner launched one of its name
    since it ended (sessions.scheduling.preemption.session_requeue)."""
    assert session_name_unused(owner=alice, name="job") == "job"
    ComputeSession.objects.create(owner=alice, name="job", resources=HALF)
    ComputeSession.objects.create(owner=alice, name="job-2", resources=HALF)
    assert session_name_unused(owner=alice, name="job") == "job-3"
    assert session_name_unused(owner=alice, name="x" * 64) == "x" * 64
    ComputeSession.objects.create(owner=alice, name="x" * 64, resources=HALF)
    assert session_name_unused(owner=alice, name="x" * 64) == "x" * 62 + "-2"


@pytest.mark.django_db
def test_fgpu_launch_says_the_name_is_taken(live_server, demo_cluster, alice, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", live_server.url)
    monkeypatch.setenv("FGPU_TOKEN", login_token_issue(user=alice))
    assert cli.main(["launch", "--gpu", "0.5", "--name", "nb"]) == 0
    capsys.readouterr()

    assert cli.main(["launch", "--gpu", "0.5", "--name", "nb"]) != 0
    err = capsys.readouterr().err
    assert "you already have a session named 'nb' that has not ended" in err, err
    assert ComputeSession.objects.filter(owner=alice, name="nb").count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_launches_at_once_with_one_name_make_one_session(demo_cluster, alice):
    """On real PostgreSQL: the second INSERT waits for the first's commit, then meets the
    constraint; its launch answers name-taken (not a 500), and one session is written."""
    made: list[str] = []

    def work(_: int) -> None:
        made.append(str(admission.session_create(owner=alice, name="race", resources=HALF).pk))

    seen = race(work, range(2), name="launch", join_s=120)
    threads, refused, errors = seen.threads, seen.refused, seen.errors
    assert not any(thread.is_alive() for thread in threads), "a launching thread is stuck"
    assert errors == []
    assert len(made) == 1 and [e.type for e in refused] == ["name-taken"], (made, refused)
    assert [str(pk) for pk in ComputeSession.objects.filter(owner=alice, name="race").values_list("pk", flat=True)] == made


@pytest.mark.django_db(transaction=True)
def test_the_migration_renames_live_sessions_that_share_a_name_before_making_the_constraint(django_user_model):
    """Sessions launched before the rule may share a name while not ended: 0017 renames all but
    the earliest of each group ("train-3": "train-2" is an ended session's), so 0018 can be made."""
    from django.db.migrations.executor import MigrationExecutor

    before = [("compute_sessions", "0016_folder_share")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("compute_sessions", "ComputeSession")
    alice = django_user_model.objects.create_user("alice")
    made = [old.objects.create(owner_id=alice.pk, name=name, status=status, resources={}, request_spec={})
            for name, status in (("train", "RUNNING"), ("train", "PENDING"), ("train", "TERMINATED"),
                                 ("train-2", "TERMINATED"), ("train", "RUNNING"), ("other", "RUNNING"))]

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

    names = {str(s.pk): s.name for s in ComputeSession.objects.filter(owner=alice)}
    assert [names[str(s.pk)] for s in made] == ["train", "train-3", "train", "train-2", "train-4", "other"]
