"""Log probabilities in OpenAI's shape: each token with its bytes and the top alternatives."""

import functools

import torch


@functools.cache
def byte_decoder():
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id):
    """The exact bytes of one token: a byte-level BPE token may hold part of a character."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    decoder = byte_decoder()
    if piece and all(char in decoder for char in piece):
        return bytes(decoder[char] for char in piece)
    return tokenizer.decode([token_id]).encode()


def entry(tokenizer, token_id, logprob):
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def logprobs_of(tokenizer, logits, token_id, top):
    """logits: [V], the model's raw output -> the chosen token's entry with `top` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = entry(tokenizer, token_id, float(logprobs[token_id]))
    values, ids = torch.topk(logprobs, top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
    chosen["top_logprobs"] = [entry(tokenizer, int(i), float(v)) for v, i in zip(values, ids)]
    return chosen
