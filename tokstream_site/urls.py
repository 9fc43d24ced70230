from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import JsonResponse
from django.urls import include, path
from django.views import defaults
from drf_spectacular.views import SpectacularAPIView

from inference.protocol.errors import not_found, server_error

API_PATHS = ("/v1/", "/api/")  # programs read errors there: OpenAI's JSON shape, never a page


def page_not_found(request, exception=None):
    if request.path.startswith(API_PATHS):
        return JsonResponse(not_found(f"No endpoint {request.path!r}.", code="unknown_url").body(), status=404)
    return defaults.page_not_found(request, exception)


def failed(request):
    if request.path.startswith(API_PATHS):
        return JsonResponse(server_error().body(), status=500)
    return defaults.server_error(request)


handler404 = page_not_found
handler500 = failed

urlpatterns = [
    path("", include("inference.chat.urls")),
    path("", include("inference.gateway.urls")),
    path("", include("billing.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
]
