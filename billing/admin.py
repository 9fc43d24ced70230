from django.contrib import admin

from .models import ApiKey, UsageEntry


@admin.register(UsageEntry)
class UsageEntryAdmin(admin.ModelAdmin):
    list_display = ["request_id", "received_at", "model", "status", "prompt_tokens", "completion_tokens", "api_key", "user"]
    list_filter = ["status", "model", "received_at"]
    search_fields = ["request_id"]
    date_hierarchy = "received_at"
    list_select_related = ["api_key", "user"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "created_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at"]
    search_fields = ["name", "prefix"]
