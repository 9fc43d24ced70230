"""Load a prepared model's weights onto a device (the files themselves: inference/model_files.py)."""

from dataclasses import dataclass

import torch

from inference.model_files import (
    context_length_of,
    load_tokenizer,
    stop_ids_of,
    tokenizer_identity,
)

from .echo import EchoModel


@dataclass
class LoadedModel:
    name: str
    model: object
    tokenizer: object
    device: torch.device
    stop_ids: frozenset
    context_length: int
    tokenizer_id: str


def pick_devices(setting="auto"):
    """The devices to run engines on, one engine each: `auto` is every CUDA GPU (else the
    CPU); otherwise a comma-separated list such as `cuda:0,cuda:1`."""
    if setting != "auto":
        return [torch.device(name.strip()) for name in setting.split(",")]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device(f"cuda:{i}") for i in range(gpus)] or [torch.device("cpu")]


def pick_dtype(device, setting="auto"):
    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # bf16 activations measured no faster on these CPUs; reduced precision pays in the weights (formats.py)


def load_echo(name, folder, step_seconds):
    """The echo model (engine/echo.py) speaking through the tokenizer in `folder`."""
    from transformers import AutoConfig

    tokenizer, config = load_tokenizer(folder), AutoConfig.from_pretrained(folder, local_files_only=True)
    return LoadedModel(
        name=name,
        model=EchoModel.for_tokenizer(tokenizer, step_seconds),
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        stop_ids=frozenset(stop_ids_of(tokenizer, config)),
        context_length=context_length_of(config),
        tokenizer_id=f"{name}:{tokenizer_identity(folder)}",
    )


def load(name, folder, device, dtype="auto"):
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=pick_dtype(device, dtype))
    model.to(device).eval()
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=device,
        stop_ids=frozenset(stop_ids_of(tokenizer, model.config)),
        context_length=context_length_of(model.config),
        tokenizer_id=f"{name}:{tokenizer_identity(folder)}",
    )
