"""The Flask application factory: `gunicorn 'api.app:create_app()'`."""
from __future__ import annotations

import logging

from flask import Flask, request
from werkzeug.middleware.proxy_fix import ProxyFix

from api import metrics, problems, server
from api.routes import admin, mcp, meta, stream, tool_calls, tool_use, workspaces
from api.runtime import Runtime
from shared import logs
from shared.settings import Settings
from shared.celery_app import create_celery


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask("runwarden", static_folder=None)
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,  # 413 before the body is parsed
        JSON_SORT_KEYS=False,
    )
    app.extensions["runwarden"] = Runtime.build(settings, create_celery(settings))
    if logs.configure(settings, also=("gunicorn.error", "gunicorn.access")):
        # A thread serves one request after another: each starts with only what it names.
        app.before_request(lambda: logs.reset(task_id=(request.view_args or {}).get("task_id")))
    problems.register(app)
    server.init_app(app)
    metrics.init_app(app, settings)
    app.register_blueprint(tool_calls.bp)
    app.register_blueprint(tool_use.bp)
    app.register_blueprint(admin.bp)
    app.register_blueprint(mcp.bp)
    app.register_blueprint(meta.bp)
    app.register_blueprint(stream.bp)
    app.register_blueprint(workspaces.bp)  # its PUT sets its own body limit, above MAX_CONTENT_LENGTH
    if settings.trusted_proxies:
        # Only then are X-Forwarded-For/-Proto/-Host/-Port/-Prefix believed, and only the last
        # `trusted_proxies` values of each (the ones our own proxies appended).
        hops = settings.trusted_proxies
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops,  # type: ignore[method-assign]
                                x_prefix=hops)
    if settings.sandbox == "none":
        logging.getLogger("runwarden").warning("RUNWARDEN_SANDBOX=none: workers run commands UNSANDBOXED")
    return app
