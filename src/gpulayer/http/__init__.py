"""Server mode: the control plane over HTTP.

``app.py`` maps the versioned JSON API (``/api/v1``) onto a
:class:`~gpulayer.service.ControlPlane`; long polls wait on the control
plane's signals from the event loop, so a waiting worker holds no thread.
``auth.py`` checks bearer tokens and roles, ``openapi.py`` describes the API,
``server.py`` runs it under uvicorn. Clients and workers reach it through
:class:`~gpulayer.transport.http.HttpTransport`.
"""
