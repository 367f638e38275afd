"""The node side: one agent per GPU node (`python manage.py agent --config agent.toml`).

Flow: the manager's start message arrives on Celery queue `agent.<node>` (agent/tasks.py) →
the Agent (agent/core.py) prepares the session (agent/environment.py: the environment contract;
agent/nvidia_smi.py: the virtual nvidia-smi; agent/mig.py: MIG instances on the node) and
starts it through a runtime (agent/runtimes.py: the interface and the `process` runtime;
agent/docker_runtime.py: one container per session) → the session's PTY is relayed through the
channel layer to the terminal consumers; reports go back to the manager as Celery tasks.
agent/config.py reads agent.toml, agent/boot.py builds an Agent from it.

The agent talks to the manager only through `protocol` (task, queue and group names, message
shapes, the exec store) and imports nothing of the manager's services, scheduler or models
(tests/test_layering.py keeps it so); it never opens the database.
"""
