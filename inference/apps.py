from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"

    def ready(self):
        from inference import replies  # noqa: F401  (settles chat replies as requests end, in every process)
