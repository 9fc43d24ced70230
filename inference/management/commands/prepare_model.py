from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from inference import model_files


class Command(BaseCommand):
    help = "Convert each packaged GGUF model once into a transformers folder in the model cache."

    def add_arguments(self, parser):
        parser.add_argument("names", nargs="*", help="models to prepare (default: all registered)")
        parser.add_argument("--force", action="store_true", help="convert again even if cached")

    def handle(self, *args, names, force, **options):
        for name in names or sorted(settings.TOKSTREAM_MODELS):
            if name not in settings.TOKSTREAM_MODELS:
                raise CommandError(f"unknown model {name!r}; registered: {', '.join(settings.TOKSTREAM_MODELS)}")
            self.prepare(name, settings.TOKSTREAM_MODELS[name]["source"], force)

    def prepare(self, name, source, force):
        if source == "echo":
            self.stdout.write(f"{name}: the echo model, on the tokenizer of {settings.TOKSTREAM_MODELS[name].get('tokenizer')}: nothing to prepare")
            return
        if not source.startswith("package:"):
            self.stdout.write(f"{name}: served from {source} as it is")
            return
        folder = model_files.cache_folder(settings.TOKSTREAM_MODEL_CACHE, name)
        if model_files.is_prepared(folder) and not force:
            self.stdout.write(f"{name}: already prepared")
            return
        try:
            gguf = model_files.package_file(source)
        except FileNotFoundError as exc:
            raise CommandError(str(exc)) from None
        with tqdm(total=len(model_files.CONVERT_STEPS), desc=f"{name}: converting {gguf.name}", unit="step") as bar:

            def advance(step):
                bar.set_postfix_str(step)
                bar.update(1)

            model_files.convert_gguf(gguf, folder, progress=advance)
        self.stdout.write(self.style.SUCCESS(f"{name}: prepared"))
