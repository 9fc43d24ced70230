import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")
# Sets Django up before the imports below touch models. Static files are served by the app
# itself, so a fresh checkout needs no collectstatic; a proxy in front may serve them instead.
django_app = ASGIStaticFilesHandler(get_asgi_application())

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from inference import backends  # noqa: E402
from inference.gateway.routing import streaming_routes  # noqa: E402

backends.warm_tokenizers()

application = ProtocolTypeRouter(
    {
        "http": URLRouter(
            [
                *streaming_routes,
                re_path(r"", django_app),
            ]
        ),
    }
)
