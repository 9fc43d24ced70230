"""The secret key an installation makes for itself (tokstream_site/config.py reads the environment)."""

import os
import secrets


def local_secret_key(path):
    """Read the key kept at `path`, making it (readable by its owner only) the first time."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_urlsafe(50))
        try:
            os.link(draft, path)  # atomic: of two processes starting at once, one key wins
        except FileExistsError:
            pass
        finally:
            os.unlink(draft)
    return path.read_text().strip()
