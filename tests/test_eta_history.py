"""ETAs you can trust (issue 32.3): a batch job's runtime history is keyed by what predicts it
(command, image, request, project; coarser keys when a fine one has too little), counts only
completed runs, and known ends (a preemption notice) come before any history."""
from __future__ import annotations

import json
from datetime import timedelta

from django.utils import timezone

from accelerators.allocation import runtime_history as history
from sessions.scheduling import eta
from sessions.models import ComputeSession, SessionStatus
from sessions.lifecycle.services import PREEMPTED, REQUESTED
from tests.seed import make_cluster, mock_gpu
from tests.test_eta import close, running, waiting

MIN = 60.0


def test_the_finest_key_with_enough_runs_is_taken_and_a_new_shape_falls_back_to_its_command():
    past = history.history_of(
        [(history.Job("train", "img", "1 gpu", "p1"), m * MIN, history.COMPLETED) for m in (10, 11, 12)]
        + [(history.Job("train", "img", "2 gpu", "p1"), m * MIN, history.COMPLETED) for m in (30, 31, 32)]
        + [(history.Job("eval", "img", "1 gpu", "p1"), m * MIN, history.COMPLETED) for m in (1, 1, 1)]
    )

    runs, basis = past.of(history.Job("train", "img", "1 gpu", "p1"))
    wider, wider_basis = past.of(history.Job("train", "img", "4 gpu", "p2"))

    assert sorted(runs) == [10 * MIN, 11 * MIN, 12 * MIN]
    assert basis == "batch history of this command, image, request and project (3 runs)"
    assert len(wider) == 6 and wider_basis == "batch history of this command and image (6 runs)"
    assert past.of(history.Job("unknown", "img", "1 gpu", "p1"))[0] == []


def test_runs_cut_short_never_make_the_runtime_only_how_early_it_may_end():
    job = history.Job("train", "img", "1 gpu", "p1")
    cut = [(job, 1 * MIN, history.CANCELLED), (job, 2 * MIN, history.PREEMPTED), (job, 3 * MIN, history.FAILED)]
    past = history.history_of([(job, 20 * MIN, history.COMPLETED)] * 3 + cut)
    only_cut = history.history_of(cut * 3)

    completed, basis = past.band(job, early_ends=False)
    band, cut_basis = past.band(job)

    assert completed == (20 * MIN, 20 * MIN) and basis.endswith("(3 runs)")
    assert band is not None and band[1] == 20 * MIN and band[0] < 2 * MIN  # the late end: completed runs only
    assert cut_basis.endswith("(3 runs; 3 cut short)")
    assert only_cut.band(job) == (None, "no batch history of this command (fewer than 3 completed runs)")


def test_a_few_rare_cut_short_runs_leave_the_band_as_completed_runs_give_it():
    job = history.Job("train", "img", "1 gpu", "p1")
    past = history.history_of([(job, 20 * MIN, history.COMPLETED)] * 40 + [(job, 1 * MIN, history.CANCELLED)])

    assert past.band(job)[0] == (20 * MIN, 20 * MIN)  # 1 of 41 runs is under the 5 % quantile


def test_a_run_counts_by_how_it_ended():
    assert eta.run_outcome(status_reason="exited", exit_code=0, preempted=False) == history.COMPLETED
    assert eta.run_outcome(status_reason="exited", exit_code=1, preempted=False) == history.FAILED
    assert eta.run_outcome(status_reason=REQUESTED + "alice", exit_code=0, preempted=False) == history.CANCELLED
    assert eta.run_outcome(status_reason=PREEMPTED + "for x", exit_code=None, preempted=False) == history.PREEMPTED
    assert eta.run_outcome(status_reason="", exit_code=0, preempted=True) == history.PREEMPTED


def past_runs(owner, command, minutes, **fields):
    now = timezone.now()
    for m in minutes:
        ComputeSession.objects.create(owner=owner, name="past", command=command, resources={},
                                      status=SessionStatus.TERMINATED, started_at=now - timedelta(days=1, minutes=m),
                                      terminated_at=now - timedelta(days=1), **fields)


def test_the_console_estimates_a_job_from_its_own_command_not_its_owners_other_jobs(db, alice, bob):
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    past_runs(alice, "python short.py", [1, 1, 1, 1, 1], exit_code=0)
    past_runs(alice, "python long.py", [20, 20, 20], exit_code=0)
    past_runs(alice, "python long.py", [2, 2], exit_code=None, status_reason=REQUESTED + "alice")  # cancelled
    past_runs(alice, "python long.py", [3], exit_code=None, status_reason=PREEMPTED + "for another")
    holder = running(alice, minutes_ago=0, command="python long.py")
    mine = waiting(bob, "next")

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "estimate"
    # the runtime from the 3 completed runs of long.py, never the owner's 1-minute short.py; its
    # 3 cut-short runs (2, 2 and 3 min) say how early it may end
    assert close(answer.latest, holder.started_at + timedelta(minutes=20), 10)
    assert close(answer.earliest, holder.started_at + timedelta(minutes=2), 10)
    basis = answer.fits_after[0].end.basis
    assert basis.startswith("batch history of this command") and basis.endswith("(3 runs; 3 cut short)")


def test_a_preemption_notice_is_a_known_end_before_any_history(db, alice, bob):
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    past_runs(alice, "python long.py", [60, 60, 60], exit_code=0)
    holder = running(alice, minutes_ago=0, command="python long.py")
    mine = waiting(bob, "next")
    stop = timezone.now() + timedelta(seconds=90)
    ComputeSession.objects.filter(pk=holder.pk).update(preempt_at=stop, version=holder.version + 1)  # under notice

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "estimate"
    assert close(answer.earliest, stop, 2) and close(answer.latest, stop, 2)
    assert answer.fits_after[0].end.basis.startswith("preemption notice")


def test_the_queue_benchmark_scores_the_console_keying_against_the_old_one(capsys):
    from benchmarks import queue_bands as bench

    assert bench.main(["--jobs", "200", "--predictions", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    assert result["jobs"] == 200 and sum(result["outcomes"].values()) == 200
    assert result["estimates"] == min(20, result["waited"]) > 0
    for name in ("console", "completed", "baseline"):
        assert sum(result[name]["counts"].values()) == result["estimates"]
    # the early side only ever reaches further: the console's bands hold every start the completed-only ones do
    assert result["console"]["in_band_pct"] >= result["completed"]["in_band_pct"]
