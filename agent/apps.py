from django.apps import AppConfig


class AgentConfig(AppConfig):
    """The node side as a Django app: its management command `agent` and its Celery tasks
    (autodiscovered from agent/tasks.py). No models: the agent never opens the database."""

    name = "agent"
    verbose_name = "Node agent"
