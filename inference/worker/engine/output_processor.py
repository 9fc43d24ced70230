"""What each new token of a sequence means: its text, whether it ends the sequence, its logprobs.

The engine hands every produced token here, in order; this module detokenizes it, checks stop
tokens, stop strings and the length limits, and tells the engine whether the sequence ends and
why, so that the engine's step only schedules, runs the model and applies the verdicts.
"""

from inference.protocol.entries import FinishReason

from .detokenizer import IncrementalDetokenizer
from .logprobs import logprobs_of


class OutputProcessor:
    def __init__(self, tokenizer, stop_ids, context_length, clock):
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.context_length = context_length
        self.clock = clock

    def start(self, request):
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop)

    def take(self, request, token):
        """One token produced -> (text now safe to show, why the sequence ends, or None)."""
        request.output_ids.append(token)
        request.all_ids.append(token)
        request.generated.append(True)
        self._first_token(request)
        if self.is_stop_token(request, token):
            return "", FinishReason.STOP
        text = request.detokenizer.add(token)
        if request.detokenizer.stopped:
            return text, FinishReason.STOP
        if self.out_of_room(request):
            return text, FinishReason.LENGTH
        return text, None

    def logprobs(self, request, logits, token):
        """The token's entry when the request asks for logprobs (as OpenAI: none for the end)."""
        if not request.params.logprobs or self.is_stop_token(request, token):
            return []
        return [logprobs_of(self.tokenizer, logits, token, request.params.top_logprobs)]

    def take_agreed(self, request, tokens):
        """A beam search's tokens agreed so far -> the text of those new since the last step."""
        new = tokens[len(request.output_ids) :]
        request.output_ids = list(tokens)
        if new:
            self._first_token(request)
        return "".join(request.detokenizer.add(t) for t in new if not self.is_stop_token(request, t))

    def flush(self, request):
        return request.detokenizer.flush() if request.detokenizer is not None else ""

    def is_stop_token(self, request, token):
        return token in self.stop_ids or token in request.params.stop_token_ids

    def out_of_room(self, request):
        return len(request.output_ids) >= request.params.max_tokens or len(request.all_ids) >= self.context_length

    def _first_token(self, request):
        if request.first_token_at is None:
            request.first_token_at = self.clock()
