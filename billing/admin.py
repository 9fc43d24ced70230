from django.contrib import admin, messages

from .models import ApiKey, Budget, PriceSheet, UsageEntry


@admin.register(UsageEntry)
class UsageEntryAdmin(admin.ModelAdmin):
    list_display = ["request_id", "received_at", "model", "status", "prompt_tokens", "completion_tokens", "total_cost", "currency", "api_key", "user"]
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


@admin.register(PriceSheet)
class PriceSheetAdmin(admin.ModelAdmin):
    """Sheets are added, never edited: a new price is a new sheet with its own effective time."""

    list_display = ["model", "effective_from", "input_per_million", "cached_input_per_million", "output_per_million", "currency"]
    list_filter = ["model"]

    def has_change_permission(self, request, obj=None):
        return obj is None  # the add form only

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["__str__", "token_limit", "money_limit", "reserved_tokens", "reserved_money"]
    list_filter = ["period"]
    readonly_fields = ["reserved_tokens", "reserved_money"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "created_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at"]
    search_fields = ["name", "prefix"]

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        raw = obj.new_secret()
        super().save_model(request, obj, form, change)
        messages.warning(request, f"The new key is {raw} — copy it now, it is not shown again.")
