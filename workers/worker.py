"""Entry point for `celery -A workers.worker worker`: settings read once, the app built, tasks registered."""
from shared.settings import Settings, SettingsError
from shared.celery_app import create_celery
from workers import runtime
from workers.lifecycle import connect_worker_signals

settings = Settings.from_env(require_jwt=False)
if settings.placement == "node" and settings.node is None:
    raise SettingsError("RUNWARDEN_PLACEMENT=node: a worker needs RUNWARDEN_NODE, its node's name")
celery = create_celery(settings)
celery.conf.include = ["workers.tasks", "workers.workspace_tasks"]
connect_worker_signals(celery, runtime.install(settings))
