"""The web process's API: the streaming ASGI apps, admission, limits, auth and the plain views."""
