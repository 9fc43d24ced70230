from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference import backends
from inference.worker import engines
from inference.worker.engine import formats


class Command(BaseCommand):
    help = "Measure the weight formats of each local model on this machine (what TOKSTREAM_WEIGHTS=auto reads) and keep the choice."

    def add_arguments(self, parser):
        parser.add_argument("names", nargs="*", help="models to measure (default: every local model with weights)")
        parser.add_argument("--force", action="store_true", help="measure again even where a choice is kept")

    def handle(self, *args, names, force, **options):
        weighted = [name for name in sorted(settings.TOKSTREAM_MODELS) if backends.of(name).engine == "weights"]
        for name in names or weighted:
            if name not in weighted:
                raise CommandError(f"{name!r} is not a local model with weights; those are: {', '.join(weighted)}")
            for device in engines.devices():
                self.measure(name, device, force)

    def measure(self, name, device, force):
        lm = engines.load(name, device)
        path = engines.formats_file(lm)
        if force:
            path.unlink(missing_ok=True)
        chosen = formats.chosen(lm.model, lm.tokenizer, lm.device, path)
        report = formats.read(path, formats.machine_key(lm.model, lm.device))
        if report is None:  # not fatal: a worker starts on the model's own dtype and measures again
            self.stderr.write(f"{name} on {device}: the timings did not agree (the CPUs were busy); nothing kept: run this again when they are idle")
            return
        self.stdout.write(f"{name} on {device}: {chosen}, kept in {path}\n  {formats.describe(report)}")
