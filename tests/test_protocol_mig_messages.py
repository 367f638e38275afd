"""The typed MIG messages between the manager and its agents (protocol.mig_messages): the manager's
`fgpu.agent.mig_reconcile` and the agent's `fgpu.manager.mig_report` round-trip, write the wire the
untyped dicts wrote (so agents and managers of adjacent versions interoperate), take an earlier
version's shape, and refuse a malformed message with a clear error, which the receiving side logs
and drops: the agent keeps running and the manager records nothing."""

from __future__ import annotations

import asyncio
import logging

import pytest

import protocol
from accelerators.models import GpuInstance
from agent import tasks as agent_tasks
from protocol.messages import Malformed, MigPlacement
from protocol.mig_messages import MigFailure, MigGpu, MigInstance, MigReconcile, MigReport, MigSlot
from sessions import tasks as manager_tasks
from tests.test_agent_runtime import Harness, run_agent
from tests.test_protocol_messages import Recording

H100 = "GPU-11111111-2222-3333-4444-555555555555"
GPU = {"gpu": H100, "index": 0, "model_name": "H100-80GB", "memory_size": 80 << 30, "subproc_count": 132}
RECONCILE = {  # as accelerators.mig_services.node_mig_push sent it before it was typed
    "node": "gpu-1",
    "gpus": [GPU],
    "expected": {H100: [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}]},
    "destroy": {H100: [{"profile": "7g.80gb", "start": 0}]},
    "kind": "layout",
    "seq": 3,
}
ANSWER = {  # agent.mig.MigManager.apply_layout's report as it was sent before it was typed
    "gpus": [H100],
    "unknown": [{"gpu": H100, "profile": "1g.10gb", "start": 3, "uuid": "MIG-aaaa"}],
    "recreated": [{"gpu": H100, "profile": "3g.40gb", "start": 4, "uuid": "MIG-bbbb"}],
    "errors": [
        {"gpu": H100, "profile": "4g.40gb", "start": 0, "reason": "the MIG instance is in use"},
        {"gpu": "GPU-gone", "profile": "", "start": None, "reason": "cannot list the MIG instances"},
    ],
    "destroyed": [{"gpu": H100, "profile": "7g.80gb", "start": 0}],
    "kind": "layout",
    "seq": 3,
}
FIRST_USE = {"gpus": [H100], "unknown": [], "recreated": [], "errors": []}  # a start spec reached the GPU first
PREPARED = {  # after a start spec's instance was made
    "gpus": [],
    "unknown": [],
    "recreated": [],
    "errors": [],
    "prepared": [{"gpu": H100, "profile": "1g.20gb", "start": 6, "uuid": "MIG-cccc"}],
}


def test_a_reconcile_decodes_to_typed_fields_and_encodes_to_the_same_keyword_arguments():
    message = MigReconcile.decode(RECONCILE)
    assert message.gpus == (MigGpu(gpu=H100, index=0, model_name="H100-80GB", memory_size=80 << 30, subproc_count=132),)
    assert message.expected[H100] == (MigPlacement("3g.40gb", 4), MigPlacement("1g.10gb", 0))
    assert message.destroy[H100] == (MigPlacement("7g.80gb", 0),)
    assert (message.kind, message.seq, message.version) == ("layout", 3, 1)
    assert message.encode() == RECONCILE  # the wire is unchanged: no version key at version 1
    assert MigReconcile.decode(message.encode()) == message


@pytest.mark.parametrize("wire", [ANSWER, FIRST_USE, PREPARED], ids=["answer", "first-use", "prepared"])
def test_each_shape_of_report_round_trips_to_the_same_json(wire):
    report = MigReport.decode(wire)
    assert report.encode() == wire
    assert MigReport.decode(report.encode()) == report


def test_a_report_s_items_are_typed():
    report = MigReport.decode(ANSWER)
    assert report.unknown == (MigInstance(gpu=H100, profile="1g.10gb", start=3, uuid="MIG-aaaa"),)
    assert report.destroyed == (MigSlot(gpu=H100, profile="7g.80gb", start=0),)
    assert report.errors[1] == MigFailure(gpu="GPU-gone", reason="cannot list the MIG instances")


def test_a_reconcile_from_a_manager_before_pushes_is_a_start_without_anything_to_destroy():
    old = {k: v for k, v in RECONCILE.items() if k not in ("destroy", "kind", "seq")}
    message = MigReconcile.decode(old)
    assert (message.destroy, message.kind, message.seq) == ({}, "start", None)


def test_a_report_of_an_earlier_agent_without_some_lists_reads_them_empty():
    report = MigReport.decode({"prepared": PREPARED["prepared"]})
    assert (report.gpus, report.unknown, report.kind) == ((), (), None)
    assert report.encode() == PREPARED


def test_later_versions_are_read_for_the_fields_this_side_knows():
    message = MigReconcile.decode({**RECONCILE, "version": 2, "compute_instances": True})
    assert message.version == 2 and message.encode()["version"] == 2
    report = MigReport.decode({**ANSWER, "version": 2, "power_draw": {H100: 300}})
    assert report.version == 2 and report.encode() == {**ANSWER, "version": 2}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"node": None}, "a MIG reconcile without 'node'"),
        ({"gpus": GPU}, "'gpus' of a MIG reconcile is not list"),
        ({"gpus": [{**GPU, "gpu": 7}]}, "'gpu' of a MIG GPU is not str"),
        ({"gpus": [{**GPU, "memory_size": -1}]}, "'memory_size' of a MIG GPU is negative"),
        ({"expected": [H100]}, "'expected' of a MIG reconcile is not dict"),
        ({"expected": {H100: {"profile": "3g.40gb"}}}, "lists GPU .* instances as no list"),
        ({"destroy": {H100: [{"profile": "7g.80gb"}]}}, "a MIG placement without 'start'"),
        ({"kind": "everything"}, "a MIG reconcile of kind 'everything'"),
        ({"seq": "3"}, "'seq' of a MIG reconcile is not a whole number"),
        ({"version": 0}, "a MIG reconcile of version 0"),
    ],
)
def test_a_malformed_reconcile_is_refused_saying_which_field(change, says):
    with pytest.raises(Malformed, match=says):
        MigReconcile.decode({**RECONCILE, **change})


@pytest.mark.parametrize(
    "change, says",
    [
        ({"gpus": H100}, "'gpus' of a MIG report is not list"),
        ({"gpus": [0]}, "'gpus' of a MIG report is not a list of strings"),
        ({"unknown": [{"gpu": H100, "profile": "1g.10gb"}]}, "a MIG instance without 'start'"),
        ({"recreated": ["MIG-bbbb"]}, "a MIG instance that is not an object"),
        ({"errors": [{"gpu": H100, "start": "0"}]}, "'start' of a MIG error is not a whole number"),
        ({"destroyed": [{"gpu": None, "profile": "7g.80gb", "start": 0}]}, "a MIG instance without 'gpu'"),
        ({"seq": 1.5}, "'seq' of a MIG report is not a whole number"),
    ],
)
def test_a_malformed_report_is_refused_saying_which_field(change, says):
    with pytest.raises(Malformed, match=says):
        MigReport.decode({**ANSWER, **change})


def test_the_agent_sends_its_report_as_the_keyword_arguments_an_earlier_manager_takes():
    manager = Recording("gpu-1")
    manager.mig_report("gpu-1", MigReport.decode(ANSWER))
    assert manager.sent == [(protocol.MIG_REPORT, {"node": "gpu-1", "report": ANSWER})]


def test_a_malformed_reconcile_is_logged_and_dropped_and_the_agent_acts_on_the_next_one(tmp_path, caplog):
    async def scenario(h: Harness):
        node = h.agent.node
        with caplog.at_level(logging.WARNING, logger="agent.tasks"):
            await asyncio.to_thread(agent_tasks.mig_reconcile, **{**RECONCILE, "node": node, "gpus": "all"})
        good = {**RECONCILE, "node": node, "destroy": {}, "expected": {H100: [{"profile": "1g.10gb", "start": 0}]}}
        await asyncio.to_thread(agent_tasks.mig_reconcile, **good)
        return await h.manager.wait_for(lambda: h.manager.mig_reports, what="the good reconcile's report")

    [(_, report)] = run_agent(tmp_path, scenario)
    assert "dropped a malformed MigReconcile: 'gpus' of a MIG reconcile is not list" in caplog.text
    assert report["kind"] == "layout" and [(r["profile"], r["start"]) for r in report["recreated"]] == [("1g.10gb", 0)]


@pytest.mark.django_db
def test_the_manager_logs_and_drops_a_malformed_report_and_applies_a_good_one(caplog):
    from tests.test_mig_scheduling import H100_UUID, mig_node

    mig_node()
    unknown = [{"gpu": H100_UUID, "profile": "1g.10gb", "start": 6, "uuid": "MIG-stranger"}]
    with caplog.at_level(logging.WARNING, logger="sessions.tasks"):
        manager_tasks.mig_report(node="mig-node", report={**FIRST_USE, "gpus": [H100_UUID], "unknown": unknown[0]})
    assert "node mig-node: dropped a malformed MIG report: 'unknown' of a MIG report is not list" in caplog.text
    assert not GpuInstance.objects.exists()
    manager_tasks.mig_report(node="mig-node", report={**FIRST_USE, "gpus": [H100_UUID], "unknown": unknown})
    assert GpuInstance.objects.get().uuid == "MIG-stranger"
