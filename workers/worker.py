"""Entry point for `celery -A workers.worker worker`: settings read once, the app built, tasks registered."""
from shared.settings import Settings
from shared.celery_app import create_celery
from workers.lifecycle import connect_worker_signals

celery = create_celery(Settings.from_env(require_jwt=False))
celery.conf.include = ["workers.tasks", "workers.workspace_tasks"]
connect_worker_signals(celery)
