"""Every project task is routed (console/celery.py): manager tasks to queue `manager`, agent
tasks to `agent.<node>`. The lists come from the Celery app itself, so a new task that the
router does not know makes these tests fail."""
from __future__ import annotations

import inspect

import pytest
from django.conf import settings

import agent.tasks  # noqa: F401  (registers the agent's tasks with the app)
import protocol
import sessions.tasks  # noqa: F401  (registers the manager's tasks with the app)
import usage.tasks  # noqa: F401  (the manager's usage tasks, issue 15)
from common.celery import HEARTBEAT_QUEUE, LOG_QUEUE, MANAGER_QUEUE, NOISY_TASKS, app, route_task

PROJECT_PACKAGES = ("sessions", "accelerators", "console", "agent", "usage")


def project_tasks() -> dict:
    return {name: task for name, task in app.tasks.items() if name.startswith("fgpu.")}


def manager_tasks() -> list[str]:
    return sorted(name for name in project_tasks() if name.startswith("fgpu.manager."))


def agent_tasks() -> list[str]:
    return sorted(name for name in project_tasks() if name.startswith("fgpu.agent."))


def test_the_app_registers_the_project_tasks_on_both_sides():
    assert "fgpu.manager.schedule_pending" in manager_tasks()
    assert "fgpu.manager.session_report" in manager_tasks()
    assert "fgpu.agent.session_start" in agent_tasks()
    assert "fgpu.agent.session_stop" in agent_tasks()


def test_the_agent_defines_every_agent_task_protocol_names_and_the_manager_none():
    names = {protocol.SESSION_START, protocol.SESSION_STOP, protocol.SESSIONS_SYNC, protocol.MIG_RECONCILE,
             protocol.SESSION_NOTICE}

    assert set(agent_tasks()) == names
    assert {app.tasks[name].__module__ for name in names} == {"agent.tasks"}
    assert {app.tasks[name].__module__ for name in manager_tasks()} == {"sessions.tasks", "usage.tasks"}


def test_every_task_defined_in_the_project_is_named_under_the_fgpu_prefix():
    ours = {name for name, task in app.tasks.items()
            if getattr(task, "__module__", "").split(".")[0] in PROJECT_PACKAGES}
    assert ours, "no project task is registered: sessions.tasks was not imported into the app"
    assert {name for name in ours if not name.startswith("fgpu.")} == set()


def test_every_fgpu_task_is_either_a_manager_or_an_agent_task():
    assert sorted(project_tasks()) == sorted(manager_tasks() + agent_tasks())


@pytest.mark.parametrize("name", sorted(project_tasks()))
def test_route_task_gives_every_fgpu_task_a_queue(name):
    route = route_task(name, (), {"node": "gpu-node-1"}, {})
    assert route is not None, f"{name} is not routed by common.celery.route_task"
    expected = (LOG_QUEUE if name in NOISY_TASKS else HEARTBEAT_QUEUE if name == protocol.AGENT_HEARTBEAT
                else protocol.USAGE_QUEUE if name == protocol.USAGE_REPORT
                else MANAGER_QUEUE if name.startswith("fgpu.manager.") else "agent.gpu-node-1")
    assert route == {"queue": expected}


@pytest.mark.parametrize("name", [name for name in manager_tasks()
                                  if name not in NOISY_TASKS and name not in (protocol.AGENT_HEARTBEAT, protocol.USAGE_REPORT)])
def test_manager_tasks_go_to_the_manager_queue_without_a_node(name):
    assert route_task(name, (), {}, {}) == {"queue": "manager"}
    assert route_task(name, (), None, {}) == {"queue": "manager"}


def test_heartbeats_and_log_batches_travel_on_queues_of_their_own_that_a_manager_worker_consumes_too():
    from celery.signals import celeryd_after_setup

    assert route_task("fgpu.manager.session_log_append", (), {}, {}) == {"queue": "manager.logs"}
    assert route_task("fgpu.manager.agent_heartbeat", (), {}, {}) == {"queue": "manager.heartbeats"}
    assert route_task("fgpu.manager.usage_report", (), {}, {}) == {"queue": "manager.usage"}

    class Worker:  # what celeryd_after_setup hands its receivers: the worker, with the app
        def __init__(self, queues):
            self.app = app
            app.amqp.queues.select(queues)

    before = list(app.amqp.queues.consume_from)
    try:
        celeryd_after_setup.send(sender="manager@test", instance=Worker(["manager"]), conf=app.conf)
        assert set(app.amqp.queues.consume_from) == {"manager", "manager.heartbeats", "manager.logs", "manager.usage"}
        celeryd_after_setup.send(sender="agent@test", instance=Worker(["agent.gpu-node-1"]), conf=app.conf)
        assert set(app.amqp.queues.consume_from) == {"agent.gpu-node-1"}
    finally:
        app.amqp.queues.select(before or None)


@pytest.mark.parametrize("name", agent_tasks())
def test_agent_tasks_go_to_the_queue_of_the_node_named_by_their_node_keyword(name):
    assert route_task(name, (), {"node": "demo-node"}, {}) == {"queue": "agent.demo-node"}
    assert route_task(name, (), {"node": "gpu-7"}, {}) == {"queue": "agent.gpu-7"}


@pytest.mark.parametrize("name", agent_tasks())
def test_an_agent_task_without_a_node_cannot_be_routed(name):
    for kwargs in ({}, None, {"node": ""}, {"node": None}):
        with pytest.raises(ValueError, match=f"task {name} needs the keyword argument node="):
            route_task(name, ("demo-node",), kwargs, {})


@pytest.mark.parametrize("name", agent_tasks())
def test_agent_tasks_take_node_as_a_keyword_only_argument(name):
    parameters = inspect.signature(app.tasks[name].run).parameters
    assert "node" in parameters, f"{name} has no node argument, so route_task cannot route it"
    assert parameters["node"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_app_uses_route_task_and_sends_unrouted_work_to_the_manager_queue():
    assert route_task in tuple(app.conf.task_routes)
    assert app.conf.task_default_queue == "manager"


@pytest.mark.parametrize("name", sorted(project_tasks()))
def test_celerys_own_router_puts_every_task_on_the_expected_queue(name):
    route = app.amqp.router.route({}, name, (), {"node": "demo-node"})
    expected = protocol.manager_queue(name) if name.startswith("fgpu.manager.") else "agent.demo-node"
    assert route["queue"].name == expected


def test_celerys_own_router_refuses_an_agent_task_without_a_node():
    with pytest.raises(ValueError, match="node="):
        app.amqp.router.route({}, "fgpu.agent.session_start", (), {"spec": {}})


def test_every_beat_entry_names_a_registered_manager_task():
    schedule = settings.CELERY_BEAT_SCHEDULE
    assert schedule
    for entry in schedule.values():
        assert entry["task"] in manager_tasks()
