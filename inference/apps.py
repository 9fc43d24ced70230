from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"

    def ready(self):
        from inference.chat import receivers  # noqa: F401  (connects the chat page to request ends)
